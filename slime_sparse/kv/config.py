"""Configuration of KV-cache compression, shared by every engine (embedded, SGLang).

The methods themselves, each with its knobs, its scores and what it needs, are classes in `methods/` (kvpress's
shape: the press dataclass is its own config). This section declares what a run chooses (method, budget, buffer,
sinks, granularity, budget schedule, preset); every method's knobs join it as flat fields generated from the method
classes (`with_method_knobs`), so each knob is declared once, on its method, and is a `--kv-*` flag, a YAML key, a
field of saved configs and a knob the presets set (`PRESET_FIELDS`) by that declaration alone. The section
validates itself once, when built.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from .methods import REGISTRY, KVMethod
from slime_sparse.utils.presets import FromPreset

from .presets import PRESETS, KVPreset


class NoCompression(KVMethod):
    """--kv-method none: a dense cache. Not a registered method (nothing to score); its traits are all off."""

    name = "none"


TRAITS: dict[str, type[KVMethod]] = {"none": NoCompression, **REGISTRY}  # what each method needs (methods/base.py)
METHODS = tuple(TRAITS)
GRANULARITIES = ("head", "layer", "model")  # per KV head and layer / one set per layer / one set for all layers
# how the budget is spread over layers (budgets.py); drift: uniform over layers, and over the run the drift guard
# moves --kv-budget (slime_sparse/drift/budget.py)
SCHEDULES = ("uniform", "pyramid", "explicit", "drift")


def method_knobs() -> dict[str, tuple[Any, dataclasses.Field]]:
    """{knob: (type, its field)} of every registered method, in registry order: a knob several methods share (the
    window, pooling, ...) must mean the same in each (one default, one help), since one flag sets it for all."""
    knobs: dict[str, tuple[Any, dataclasses.Field]] = {}
    for method in REGISTRY.values():
        hints = typing.get_type_hints(method)
        for f in method.knobs():
            if f.name in knobs:
                first = knobs[f.name][1]
                if (first.default, first.metadata.get("help")) != (f.default, f.metadata.get("help")):
                    raise TypeError(f"KV method {method.__name__}: knob {f.name!r} differs from another method's "
                                    "(default or help): one flag cannot set both")
                continue
            knobs[f.name] = (hints[f.name], f)
    return knobs


def with_method_knobs(cls: type) -> type:
    """Give config class `cls` (under @dataclass) a field per method knob, after its own, with the method's type,
    default and help; they are the knobs its presets set (PRESET_FIELDS)."""
    annotations = cls.__dict__.get("__annotations__", {})
    for name, (tp, f) in method_knobs().items():
        if name in annotations:
            raise TypeError(f"{cls.__name__}.{name} is a KV method's knob: declare it on the method only")
        annotations[name] = tp
        setattr(cls, name, field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
    cls.__annotations__ = annotations
    cls.PRESET_FIELDS = tuple(method_knobs())
    return cls


@dataclass(frozen=True)
@with_method_knobs
class KVCompressConfig(FromPreset):
    """The run's KV compression: the fields below, then every registered method's knobs (`with_method_knobs`)."""

    method: str = field(default="none", metadata={"help": (
        "KV compression of rollouts: none (dense) | " + " | ".join(REGISTRY))})
    budget: int = field(default=512, metadata={"help": (
        "B: KV tokens kept per sequence and layer after a compression (the mean over layers under "
        "--kv-budget-schedule pyramid)")})
    buffer: int = field(default=128, metadata={"help": (
        "decode tokens between compressions: the cache cycles between B and B + buffer")})
    n_sink: int | None = field(default=None, metadata={"help": (
        "first tokens always kept; unset: the method's (streaming 4, others 0)")})
    # See kv/selection.py.
    granularity: str = field(default="head", metadata={"help": (
        "head: each KV head of each layer selects | layer: one set per layer (mean of its heads' scores) | "
        "model: one set for all layers")})
    budget_schedule: str | None = field(default=None, metadata={"help": (
        "uniform: every layer keeps --kv-budget | pyramid: PyramidKV's budgets, shrinking with depth, mean "
        "--kv-budget | explicit: --kv-layer-budgets | drift: uniform, and the run's drift guard raises the budget (x2, up to "
        "--kv-budget-max or dense) when compressed rollouts earn significantly less than dense ones, and lowers it "
        "again when the budget below shows no gap; unset: the method's (pyramidkv: pyramid, others uniform)")})
    layer_budgets: tuple[int, ...] = field(default=(), metadata={"help": (
        "one budget per layer, first layer first (needs --kv-budget-schedule explicit; --kv-budget is then "
        "unused)")})
    preset: str = field(default="", metadata={"help": (
        "sparse-rl-fork | rkv-code | kvpress: the reference implementation whose knob values to start from "
        "(other --kv-* flags override; slime_sparse/kv/presets.py names each source); unset: the knobs as given, "
        "whose defaults are sparse-rl-fork's, the settings the Sparse-RL results were produced with")})

    FLAG_PREFIX: ClassVar[str] = "--kv-"
    PRESETS: ClassVar[Mapping[str, KVPreset]] = PRESETS
    # how a method scores, what a preset defines (presets.py): the method knobs (`with_method_knobs` sets it); method,
    # budget and layout stay the run's
    PRESET_FIELDS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.layer_budgets, tuple):  # a list from JSON / YAML
            object.__setattr__(self, "layer_budgets", tuple(self.layer_budgets))
        super().__post_init__()
        self.validate()

    def covered_by(self, preset: KVPreset) -> bool:
        return self.method in preset.methods or not self.enabled

    @classmethod
    def check_preset(cls, name: str, overrides: Mapping[str, Any]) -> None:
        method = overrides.get("method", cls.method)
        if method not in METHODS:  # a typo in the method, not a gap in the preset: name the methods
            raise ValueError(f"{cls.flag('method')}={method!r} is invalid: choose one of {METHODS}")
        if method != "none" and method not in PRESETS[name].methods:
            covering = [n for n, p in PRESETS.items() if method in p.methods]
            raise ValueError(f"{cls.flag('preset')}={name!r} is invalid: has no settings for "
                             f"{cls.flag('method')}={method} (presets that do: {covering or 'none'})")

    @property
    def schedule(self) -> str:
        """How the budget is spread over layers: --kv-budget-schedule, else the method's (drift: uniform; what moves
        is the budget itself, between rollouts)."""
        if self.budget_schedule == "drift":
            return "uniform"
        return self.budget_schedule if self.budget_schedule is not None else self.traits.default_schedule

    @property
    def adaptive(self) -> bool:
        """--kv-budget-schedule drift: the run's drift guard moves --kv-budget (slime_sparse/drift)."""
        return self.budget_schedule == "drift"

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
    def traits(self) -> type[KVMethod]:
        """What the method needs from an engine (class attributes of its class in `methods/`)."""
        return TRAITS[self.method]

    @property
    def scorer(self) -> KVMethod:
        """The method with this config's knobs, built once per config (needs an enabled method)."""
        if not self.enabled:
            raise ValueError("--kv-method=none: KV compression is disabled, there is nothing to score")
        return _scorer(self)

    def validate(self, prefix: str = "--kv-") -> None:
        """Raise ValueError naming the offending flag."""

        def bad(name: str, value, allowed: str) -> None:
            raise ValueError(f"{prefix}{name}={value!r} is invalid: {allowed}")

        if self.method not in METHODS:
            bad("method", self.method, f"choose one of {METHODS}")
        if self.granularity not in GRANULARITIES:
            bad("granularity", self.granularity, f"choose one of {GRANULARITIES}")
        if self.buffer < 1:
            bad("buffer", self.buffer, "must be >= 1")
        if self.n_sink is not None and self.n_sink < 0:
            bad("n-sink", self.n_sink, "must be >= 0")
        for cls in REGISTRY.values():  # every knob's range, whichever method owns it (each checks its own)
            cls.from_config(self)
        if self.schedule not in SCHEDULES:
            bad("budget-schedule", self.schedule, f"choose one of {SCHEDULES}")
        if self.adaptive and not self.enabled:
            bad("budget-schedule", self.budget_schedule, "adapts the budget of a compressing --kv-method, not of none")
        if (self.schedule == "explicit") != bool(self.layer_budgets):
            bad("layer-budgets", self.layer_budgets, "is set exactly when --kv-budget-schedule is explicit")
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


@functools.lru_cache(maxsize=32)
def _scorer(cfg: KVCompressConfig) -> KVMethod:
    return REGISTRY[cfg.method].from_config(cfg)
