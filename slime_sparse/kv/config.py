"""Configuration of KV-cache compression, shared by every engine (embedded, SGLang), and what each method needs."""
from __future__ import annotations

from dataclasses import dataclass


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
    method: str = "none"
    budget: int = 512  # B: tokens kept after a compression
    buffer: int = 128  # decode tokens between compressions; cache cycles between B and B + buffer
    window: int = 8  # observation window: last `window` queries score, last `window` tokens always kept
    kernel_size: int = 7  # pooling kernel over token scores (SnapKV, R-KV)
    pooling: str = "max"
    mix_lambda: float = 0.1  # R-KV: score = lambda * importance - (1 - lambda) * redundancy
    sim_threshold: float = 0.5  # R-KV: newest near-duplicate (cosine > threshold) is exempt from redundancy
    n_sink: int | None = None  # first tokens always kept; None = the method's default (streaming 4, others 0)
    # How the query heads of one KV group are reduced: on the attention logits for rkv (as R-KV, which uses max),
    # on the per-head scores after window sum and pooling for snapkv / h2o (as kvpress, which uses mean).
    gqa_reduce: str = "max"  # over the query heads of a KV group; max as in R-KV and the authors' SGLang
    # head: each KV head of each layer selects; layer: one set per layer (mean of its heads' scores);
    # model: one set for all layers (mean over layers of those means). See kv/selection.py.
    granularity: str = "head"

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
