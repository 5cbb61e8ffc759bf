"""Configuration of KV-cache compression, shared by every engine (embedded, SGLang), and what each method needs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MethodTraits:
    """What a compression method asks of the engine that runs it (scoring.py holds the methods themselves)."""

    needs_queries: bool = False  # scores with the last `window` post-RoPE queries of the sequence
    tracks_mass: bool = False  # scores with the attention mass each slot received over the whole sequence
    compresses_after_prefill: bool = False  # also cuts the prompt to the budget once it is prefilled (schedule.py)
    default_sinks: int = 0  # first tokens always kept unless --kv-n-sink says otherwise


TRAITS: dict[str, MethodTraits] = {
    "none": MethodTraits(),
    "snapkv": MethodTraits(needs_queries=True, compresses_after_prefill=True),  # SnapKV's own use: the prompt
    "rkv": MethodTraits(needs_queries=True),
    "streaming": MethodTraits(default_sinks=4),  # 4 sinks + the most recent tokens: positions only
    "h2o": MethodTraits(tracks_mass=True),  # falls back to the window's queries when the engine tracks no mass
}
METHODS = tuple(TRAITS)
GQA_REDUCTIONS = ("mean", "max")
GRANULARITIES = ("head", "layer", "model")  # per KV head and layer / one set per layer / one set for all layers
POOLINGS = ("max", "avg")


@dataclass(frozen=True)
class KVCompressConfig:
    method: str = field(default="none", metadata={"help": (
        "KV compression of rollouts: none (dense) | snapkv | rkv | streaming | h2o")})
    budget: int = field(default=512, metadata={"help": "B: KV tokens kept per sequence after a compression"})
    buffer: int = field(default=128, metadata={"help": (
        "decode tokens between compressions: the cache cycles between B and B + buffer")})
    window: int = field(default=8, metadata={"help": (
        "observation window: the last `window` queries score, the last `window` tokens are always kept")})
    kernel_size: int = field(default=7, metadata={"help": "pooling kernel over token scores (SnapKV, R-KV)"})
    pooling: str = field(default="max", metadata={"help": "max | avg pooling of token scores"})
    mix_lambda: float = field(default=0.1, metadata={"help": (
        "R-KV: score = lambda x importance - (1 - lambda) x redundancy")})
    sim_threshold: float = field(default=0.5, metadata={"help": (
        "R-KV: the newest near-duplicate (cosine > threshold) is exempt from redundancy")})
    n_sink: int | None = field(default=None, metadata={"help": (
        "first tokens always kept; unset: the method's (streaming 4, others 0)")})
    # On the attention logits for rkv (as R-KV, which uses max), on the per-head scores after window sum and
    # pooling for snapkv / h2o (as kvpress, which uses mean).
    gqa_reduce: str = field(default="max", metadata={"help": (
        "max | mean over the query heads of a KV group (max as in R-KV and the authors' SGLang)")})
    # See kv/selection.py.
    granularity: str = field(default="head", metadata={"help": (
        "head: each KV head of each layer selects | layer: one set per layer (mean of its heads' scores) | "
        "model: one set for all layers")})

    @property
    def sinks(self) -> int:
        if self.n_sink is not None:
            return self.n_sink
        return self.traits.default_sinks

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def traits(self) -> MethodTraits:
        return TRAITS[self.method]

    def validate(self, prefix: str = "--kv-") -> None:
        """Raise ValueError naming the offending flag."""

        def bad(name: str, value, allowed: str) -> None:
            raise ValueError(f"{prefix}{name}={value!r} is invalid: {allowed}")

        if self.method not in METHODS:
            bad("method", self.method, f"choose one of {METHODS}")
        if self.gqa_reduce not in GQA_REDUCTIONS:
            bad("gqa-reduce", self.gqa_reduce, f"choose one of {GQA_REDUCTIONS}")
        if self.granularity not in GRANULARITIES:
            bad("granularity", self.granularity, f"choose one of {GRANULARITIES}")
        if self.pooling not in POOLINGS:
            bad("pooling", self.pooling, f"choose one of {POOLINGS}")
        if self.window < 1:
            bad("window", self.window, "must be >= 1")
        if self.buffer < 1:
            bad("buffer", self.buffer, "must be >= 1")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            bad("kernel-size", self.kernel_size, "must be an odd integer >= 1")
        if not 0.0 <= self.mix_lambda <= 1.0:
            bad("mix-lambda", self.mix_lambda, "must lie in [0, 1]")
        if self.n_sink is not None and self.n_sink < 0:
            bad("n-sink", self.n_sink, "must be >= 0")
        if self.enabled and self.budget <= self.window + self.sinks:
            bad("budget", self.budget, f"must exceed window + sinks = {self.window + self.sinks}")
