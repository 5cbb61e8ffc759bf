"""Configuration of KV-cache compression, shared by every engine (embedded, SGLang), and what each method needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from .presets import PRESETS, FromPreset, KVPreset


@dataclass(frozen=True)
class MethodTraits:
    """What a compression method asks of the engine that runs it (scoring.py holds the methods themselves)."""

    needs_queries: bool = False  # scores with the last `window` post-RoPE queries of the sequence
    tracks_mass: bool = False  # scores with the attention mass each slot received over the whole sequence
    compresses_after_prefill: bool = False  # also cuts the prompt to the budget once it is prefilled (schedule.py)
    default_sinks: int = 0  # first tokens always kept unless --kv-n-sink says otherwise
    default_schedule: str = "uniform"  # per-layer budgets unless --kv-budget-schedule says otherwise (budgets.py)


TRAITS: dict[str, MethodTraits] = {
    "none": MethodTraits(),
    "snapkv": MethodTraits(needs_queries=True, compresses_after_prefill=True),  # SnapKV's own use: the prompt
    "rkv": MethodTraits(needs_queries=True),
    "streaming": MethodTraits(default_sinks=4),  # 4 sinks + the most recent tokens: positions only
    "h2o": MethodTraits(tracks_mass=True),  # falls back to the window's queries when the engine tracks no mass
    # SnapKV's scores under PyramidKV's budgets, shrinking with depth (a prefill method, as SnapKV)
    "pyramidkv": MethodTraits(needs_queries=True, compresses_after_prefill=True, default_schedule="pyramid"),
    "keydiff": MethodTraits(),  # keys only: no queries, no attention mass
}
METHODS = tuple(TRAITS)
GQA_REDUCTIONS = ("mean", "max")
GRANULARITIES = ("head", "layer", "model")  # per KV head and layer / one set per layer / one set for all layers
POOLINGS = ("max", "avg")
SCHEDULES = ("uniform", "pyramid", "explicit")  # how the budget is spread over layers (budgets.py)


@dataclass(frozen=True)
class KVCompressConfig(FromPreset):
    method: str = field(default="none", metadata={"help": (
        "KV compression of rollouts: none (dense) | snapkv | rkv | streaming | h2o | pyramidkv | keydiff")})
    budget: int = field(default=512, metadata={"help": (
        "B: KV tokens kept per sequence and layer after a compression (the mean over layers under "
        "--kv-budget-schedule pyramid)")})
    buffer: int = field(default=128, metadata={"help": (
        "decode tokens between compressions: the cache cycles between B and B + buffer")})
    window: int = field(default=8, metadata={"help": (
        "observation window: the last `window` queries score, the last `window` tokens are always kept (not under "
        "--kv-preset kvpress for keydiff and streaming, which kvpress protects none of)")})
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
    budget_schedule: str | None = field(default=None, metadata={"help": (
        "uniform: every layer keeps --kv-budget | pyramid: PyramidKV's budgets, shrinking with depth, mean "
        "--kv-budget | explicit: --kv-layer-budgets; unset: the method's (pyramidkv: pyramid, others uniform)")})
    layer_budgets: tuple[int, ...] = field(default=(), metadata={"help": (
        "one budget per layer, first layer first (needs --kv-budget-schedule explicit; --kv-budget is then "
        "unused)")})
    pyramid_beta: float = field(default=10.0, metadata={"help": (
        "PyramidKV's beta: the last layer keeps 1/beta of the mean selectable budget (--kv-budget minus window "
        "and sinks), the first twice that mean minus it")})
    preset: str = field(default="", metadata={"help": (
        "sparse-rl-fork | rkv-code | kvpress: the reference implementation whose knob values to start from "
        "(other --kv-* flags override; slime_sparse/kv/presets.py names each source); unset: the knobs as given, "
        "whose defaults are sparse-rl-fork's, the settings the Sparse-RL results were produced with")})

    FLAG_PREFIX: ClassVar[str] = "--kv-"
    PRESETS: ClassVar[Mapping[str, KVPreset]] = PRESETS
    # how a method scores: what a preset defines (presets.py); method, budget and layout stay the run's
    PRESET_FIELDS: ClassVar[tuple[str, ...]] = ("window", "kernel_size", "pooling", "gqa_reduce", "mix_lambda",
                                                "sim_threshold", "pyramid_beta")

    def __post_init__(self) -> None:
        if not isinstance(self.layer_budgets, tuple):  # a list from JSON / YAML
            object.__setattr__(self, "layer_budgets", tuple(self.layer_budgets))
        super().__post_init__()

    def covered_by(self, preset: KVPreset) -> bool:
        return self.method in preset.methods or not self.enabled

    @classmethod
    def check_preset(cls, name: str, overrides: Mapping[str, Any]) -> None:
        method = overrides.get("method", cls.method)
        if method != "none" and method not in PRESETS[name].methods:
            covering = [n for n, p in PRESETS.items() if method in p.methods]
            raise ValueError(f"{cls.flag('preset')}={name!r} is invalid: has no settings for "
                             f"{cls.flag('method')}={method} (presets that do: {covering or 'none'})")

    @property
    def schedule(self) -> str:
        """The budget schedule in force: --kv-budget-schedule, else the method's."""
        return self.budget_schedule if self.budget_schedule is not None else self.traits.default_schedule

    @property
    def protected_window(self) -> int:
        """The last slots every compression keeps unscored: the window, or none where the preset's reference
        protects none for this method (presets.py `no_window`: kvpress's KeyDiff and StreamingLLM). A rule of the
        preset rather than a flag or --kv-window 0, because the window also sizes the query ring every engine
        keeps, and only a reference's definition of a method ever needs the two apart."""
        preset = PRESETS.get(self.preset)
        return 0 if preset is not None and self.method in preset.no_window else self.window

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
        if self.schedule not in SCHEDULES:
            bad("budget-schedule", self.schedule, f"choose one of {SCHEDULES}")
        if (self.schedule == "explicit") != bool(self.layer_budgets):
            bad("layer-budgets", self.layer_budgets, "is set exactly when --kv-budget-schedule is explicit")
        if self.pyramid_beta < 1:
            bad("pyramid-beta", self.pyramid_beta, "must be >= 1")
        if self.enabled and self.granularity == "model" and self.schedule != "uniform":
            # one set for all layers cannot be kept at several sizes: after one compression the layers hold
            # different slots, and no single ranking covers them
            bad("granularity", self.granularity, f"model needs one budget for every layer, not --kv-budget-schedule "
                f"{self.schedule} (use head or layer)")
        if self.preset != "custom" and self.preset not in PRESETS:
            bad("preset", self.preset, f"choose one of {tuple(PRESETS)}")
        protected = self.protected_window + self.sinks
        if self.enabled and self.schedule == "explicit":
            if min(self.layer_budgets) < protected:  # a layer may keep only its window and sinks (pyramid tops)
                bad("layer-budgets", self.layer_budgets, f"every budget must be >= window + sinks = {protected}")
        elif self.enabled and self.budget <= protected:
            bad("budget", self.budget, f"must exceed window + sinks = {protected}")
