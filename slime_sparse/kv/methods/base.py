"""What a KV-compression method is: a small dataclass that owns its knobs, says what it needs from an engine, and
scores cache slots (kvpress's `ScorerPress` shape). Selection (top-k under the protected sinks and window), the
granularity (per head / layer / model) and the schedule (when to compress) are shared by every method and live
elsewhere in `slime_sparse.kv`.

A method is registered by name (`@register`); the config, the CLI's choices, the presets and both engines read the
registry, so adding a method is one module in this package plus its test:

    @register
    @dataclass(frozen=True)
    class MyPress(KVMethod):
        # docstring: what it keeps and why (paper, reference code)
        name = "mypress"
        needs_queries = True          # what it asks of the engine (class attributes below)
        gqa_reduce: str = gqa_knob()  # its knobs: dataclass fields

        def score(self, keys, queries, attn_mass=None):   # [..., Hkv, n, d] -> [..., Hkv, n], batched
            ...
            return with_protected(scores[..., : scored_length(self.window, n)], n, self.sinks)

        def score_bytes(self, s: ScoreShape) -> int:       # the peak bytes `score` allocates for a call of shape s
            ...

and an import line in `methods/__init__.py` (the registry's order is the CLI's). The class is the knobs' one
declaration (kvpress: the press dataclass is its own config): each field becomes a field of the run's
`KVCompressConfig` (kv/config.py `with_method_knobs`), and so a `--kv-*` flag with this help and default, a YAML key of
section `kv`, a saved config's field and a knob the presets set. A knob several methods share is declared once here
(`window_knob`, `kernel_knob`, ...): one flag sets it for all.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from ..ops import GQA_REDUCTIONS, POOLINGS

FLAG_PREFIX = "--kv-"


def knob(default: Any, help: str) -> Any:
    """A method's tunable: its default and the help its `--kv-*` flag shows."""
    return field(default=default, metadata={"help": help})


# Knobs several methods share, declared once.
def window_knob() -> Any:
    return knob(8, "observation window: the last `window` queries score, the last `window` tokens are always kept (not "
                   "under --kv-preset kvpress for keydiff and streaming, which kvpress protects none of)")


def kernel_knob() -> Any:
    return knob(7, "pooling kernel over token scores (SnapKV, R-KV)")


def pooling_knob() -> Any:
    return knob("max", "max | avg pooling of token scores")


def gqa_knob() -> Any:
    # On the attention logits for rkv (as R-KV, which uses max), on the per-head scores after window sum and pooling
    # for snapkv / h2o (as kvpress, which uses mean).
    return knob("max", "max | mean over the query heads of a KV group (max as in R-KV and the authors' SGLang)")


def bad_knob(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{FLAG_PREFIX}{name.replace('_', '-')}={value!r} is invalid: {why}")


@dataclass(frozen=True)
class ScoreShape:
    """One `score` call as the memory accounting sees it: `entries` (layer, row) pairs of `heads` KV heads holding
    `slots` keys of `head_dim` in `dtype_bytes` each, scored with `queries` window queries of `q_heads` heads, on a
    `device` ("cuda" or "cpu": R-KV's search differs)."""

    entries: int
    heads: int
    q_heads: int
    head_dim: int
    slots: int
    queries: int
    dtype_bytes: int
    device: str = "cuda"

    @property
    def keys(self) -> int:
        """Key elements: entries x heads x slots x head_dim."""
        return self.entries * self.heads * self.slots * self.head_dim

    @property
    def per_slot(self) -> int:
        """One value per (entry, head, slot): a score's elements."""
        return self.entries * self.heads * self.slots

    @property
    def upcast(self) -> int:
        """Bytes per element of an fp32 copy of a half-precision input (`.float()` of fp32 copies nothing)."""
        return 4 if self.dtype_bytes != 4 else 0


def window_logits_bytes(s: ScoreShape, window: int) -> int:
    """Peak bytes of `ops.causal_window_attention` (SnapKV): fp32 copies of the keys and queries while the logits are
    computed, the logits and their scaled copy, then logits, the masked copy and the softmax; then the sums over the
    window, pooled and reduced over each KV group, and the protected scores."""
    logits = 4 * s.entries * s.q_heads * s.queries * s.slots
    queries = s.upcast * s.entries * s.q_heads * s.queries * s.head_dim
    scored = s.entries * max(s.slots - window, 0)
    tail = 4 * s.entries * s.q_heads * s.slots + 4 * scored * (s.q_heads + s.heads) + 4 * s.per_slot
    return max(s.upcast * s.keys + queries + logits, queries + 2 * logits, 3 * logits + s.queries * s.slots, tail)


@dataclass(frozen=True)
class KVMethod:
    """Base of every method. Subclasses add their knobs as fields and implement `score`.

    Class attributes say what the method needs from the engine that runs it:
    - needs_queries: scores with the last `window` post-RoPE queries of the sequence (the engine keeps a query ring);
    - tracks_mass: scores with the attention mass each slot received over the whole sequence (explicit attention);
    - compresses_after_prefill: also cuts a prompt to the budget once it is prefilled (schedule.py);
    - position_only: the scores depend on slot order alone, so every head and layer keeps the same slots (the
      eviction record stores one set);
    - default_sinks / default_schedule: the first tokens always kept and the per-layer budgets unless
      --kv-n-sink / --kv-budget-schedule say otherwise.
    """

    name: ClassVar[str] = ""
    needs_queries: ClassVar[bool] = False
    tracks_mass: ClassVar[bool] = False
    compresses_after_prefill: ClassVar[bool] = False
    position_only: ClassVar[bool] = False
    default_sinks: ClassVar[int] = 0
    default_schedule: ClassVar[str] = "uniform"

    window: int = window_knob()
    sinks: int = 0  # the run's (--kv-n-sink, else default_sinks): filled in by `from_config`

    def __post_init__(self) -> None:
        if self.window < (1 if self.needs_queries else 0):
            raise bad_knob("window", self.window, "must be >= 1")

    @classmethod
    def knobs(cls) -> tuple[dataclasses.Field, ...]:
        """The method's tunables (its dataclass fields but `sinks`, which the run config derives)."""
        return tuple(f for f in dataclasses.fields(cls) if f.name != "sinks")

    @classmethod
    def from_config(cls, cfg: Any) -> "KVMethod":
        """The method with its knobs read from a run's KV config (`KVCompressConfig`); its window is the one the run
        protects (`cfg.protected_window`: none for a method whose preset's reference protects none)."""
        knobs = {f.name: getattr(cfg, f.name) for f in cls.knobs()}
        if cfg.method == cls.name:
            knobs["window"] = cfg.protected_window
        return cls(**knobs, sinks=cfg.sinks)

    def score(self, keys: Tensor, queries: Tensor, attn_mass: Tensor | None = None) -> Tensor:
        """Scores of every slot: keys [..., Hkv, n, d], queries [..., Hq, w, d] (w <= window), attn_mass
        [..., Hkv, n] (methods that track it) -> [..., Hkv, n] float32, higher = keep; the sinks and the last
        `window` slots carry +inf. Leading dims broadcast (layers x rows of an engine step): an entry's scores equal
        that entry scored alone."""
        raise NotImplementedError

    def score_bytes(self, s: ScoreShape) -> int:
        """Peak bytes `score` allocates for a call of shape `s` (inputs excluded, its output included), as torch's
        allocator sees them: what the compressor sizes its chunks by and the engine's admission counts
        (kv/engine_memory.py). Checked against measured allocations (tests/rollout/embedded/test_engine_memory.py)."""
        raise NotImplementedError


def check_pooling(kernel_size: int, pooling: str) -> None:
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise bad_knob("kernel_size", kernel_size, "must be an odd integer >= 1")
    if pooling not in POOLINGS:
        raise bad_knob("pooling", pooling, f"choose one of {POOLINGS}")


def check_gqa(gqa_reduce: str) -> None:
    if gqa_reduce not in GQA_REDUCTIONS:
        raise bad_knob("gqa_reduce", gqa_reduce, f"choose one of {GQA_REDUCTIONS}")


REGISTRY: dict[str, type[KVMethod]] = {}


def register(cls: type[KVMethod]) -> type[KVMethod]:
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"KV method {cls.__name__}: name {cls.name!r} is empty or taken")
    REGISTRY[cls.name] = cls
    return cls
