"""`FromPreset`: the one mechanism by which a config dataclass starts from a named preset, and `Preset`, what a
preset is (knob values and where they were read). The KV compression (slime_sparse/kv/presets.py: kvpress's, R-KV's
and the Sparse-RL fork's values) and the sparsity correction (slime_sparse/algo/correction_config.py: the paper's
and verl's) both build on it; it imports neither, so neither imports the other for it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping


@dataclass(frozen=True)
class Preset:
    """A named starting point of a config: knob values and where they were read."""

    reference: str  # where the values were read: repository @ commit, file, line / paper section
    values: Mapping[str, Any] = field(default_factory=dict)  # field -> value; the config's other knobs: defaults


class FromPreset:
    """A config dataclass that starts from named presets. `preset` (a field of the subclass) names the preset the
    knobs started from (`from_preset`, `from_dict`); when the config is built directly, the preset whose knobs
    these all equal, or "custom". A preset defines the subclass's PRESET_FIELDS: the values it names, the others
    at their defaults; every other field belongs to the run. Errors name the flag (FLAG_PREFIX + field)."""

    PRESETS: ClassVar[Mapping[str, Preset]]
    PRESET_FIELDS: ClassVar[tuple[str, ...] | None] = None  # None: every field but `preset`
    FLAG_PREFIX: ClassVar[str]

    def __post_init__(self) -> None:
        if not self.preset:
            object.__setattr__(self, "preset", self.equal_preset())

    def covered_by(self, preset: Preset) -> bool:
        """Whether `preset` has settings for this config (KV: for its method)."""
        return True

    @classmethod
    def check_preset(cls, name: str, overrides: Mapping[str, Any]) -> None:
        """Refuse a preset that has no settings for the config `overrides` ask for (KV: another method)."""

    @classmethod
    def preset_knobs(cls, name: str) -> dict[str, Any]:
        """Every knob preset `name` defines: its values over the defaults of PRESET_FIELDS."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name != "preset"
                    and (cls.PRESET_FIELDS is None or f.name in cls.PRESET_FIELDS)}
        return {**defaults, **cls.PRESETS[name].values}

    def equal_preset(self) -> str:
        """The first preset that covers this config and whose knobs these all equal, or "custom"."""
        return next((name for name, p in self.PRESETS.items() if self.covered_by(p)
                     and all(getattr(self, k) == v for k, v in self.preset_knobs(name).items())), "custom")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """The config's section of a run config: its `preset` (if it names one) with the knobs it sets on top. A
        section saved before a knob existed lacks it: the knob keeps its default, which is the old behaviour."""
        values = dict(values)
        preset = values.pop("preset", "")
        if preset in ("", "custom"):
            return cls(**values)
        return cls.from_preset(preset, **values)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any):
        """Preset `name` with some knobs overridden; the result is validated."""
        if name not in cls.PRESETS:
            raise ValueError(f"{cls.flag('preset')}={name!r} is invalid: choose one of {tuple(cls.PRESETS)}")
        known = {f.name for f in dataclasses.fields(cls)} - {"preset"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(cls.flag(k) for k in unknown)}: known are {sorted(known)}")
        cls.check_preset(name, overrides)
        cfg = cls(**{**cls.preset_knobs(name), **overrides, "preset": name})
        cfg.validate()
        return cfg

    @classmethod
    def flag(cls, name: str) -> str:
        return cls.FLAG_PREFIX + name.replace("_", "-")
