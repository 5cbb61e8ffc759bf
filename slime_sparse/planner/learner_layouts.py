"""Which TP x PP x DP layouts of the Megatron learner a model allows, and which of them fit a GPU (the planner's).

Megatron splits attention heads and KV heads (query groups) over tensor-parallel ranks and whole layers over
pipeline stages, so TP must divide both head counts and PP the layer count (what our Megatron learner checks when
it builds, `backends/megatron/model_config.py`); a layout that breaks one of these is listed with the reason,
never planned. Memory per GPU: `memory.plan_learner` (weights, gradients, optimizer) plus one micro-batch's
activations divided by TP x PP, by --recompute-granularity.
"""
from __future__ import annotations

from dataclasses import dataclass

from slime_sparse.utils.model_shape import ModelShape

from .memory import GIB, plan_learner

RECOMPUTE = (None, "selective", "full")  # cheapest first: a layout that fits without recompute trains fastest


def layout_problems(shape: ModelShape, tp: int, pp: int) -> list[str]:
    """Why the model cannot be split TP x PP ways (empty: it can)."""
    problems = [f"TP {tp} does not divide the {n} {what}" for n, what in
                ((shape.num_heads, "attention heads"), (shape.num_kv_heads, "KV heads")) if n % tp]
    if shape.num_layers % pp:
        problems.append(f"PP {pp} does not divide the {shape.num_layers} layers")
    return problems


def layouts_of(gpus: int) -> list[tuple[int, int, int]]:
    """Every (TP, PP, DP) with TP x PP x DP = gpus."""
    if gpus < 1:
        raise ValueError(f"--gpus={gpus} must be >= 1")
    return [(tp, pp, gpus // (tp * pp)) for tp in range(1, gpus + 1) if gpus % tp == 0
            for pp in range(1, gpus // tp + 1) if (gpus // tp) % pp == 0]


@dataclass(frozen=True)
class LayoutPlan:
    tp: int
    pp: int
    dp: int
    problems: tuple[str, ...]  # why the model cannot be split so (then nothing else is planned)
    state_bytes: int = 0  # weights, gradients, optimizer (and reference) per GPU
    total_bytes: tuple[int, ...] = ()  # state + activations per GPU, by RECOMPUTE

    @property
    def name(self) -> str:
        return f"{self.tp}x{self.pp}x{self.dp}"

    def fits_with(self, gpu_bytes: int) -> str | None:
        """The cheapest --recompute-granularity with which it fits ("none", "selective", "full"), or None."""
        if self.problems:
            return None
        return next((r or "none" for r, total in zip(RECOMPUTE, self.total_bytes) if total <= gpu_bytes), None)


def plan_layout(shape: ModelShape, tp: int, pp: int, dp: int, activations: dict, with_ref: bool) -> LayoutPlan:
    """One layout: its problems, or its memory per GPU; `activations` {recompute: bytes of one micro-batch}."""
    problems = layout_problems(shape, tp, pp)
    if problems:
        return LayoutPlan(tp, pp, dp, tuple(problems))
    state = plan_learner(shape, tp=tp, pp=pp, dp=dp, with_ref=with_ref).bytes_per_gpu
    return LayoutPlan(tp, pp, dp, (), state, tuple(state + activations[r] // (tp * pp) for r in RECOMPUTE))


def rank_layouts(plans: list[LayoutPlan], gpu_bytes: int) -> list[LayoutPlan]:
    """Best first: those that fit before those that do not, then the least recompute, then the fewest model-parallel
    ranks (more data parallelism: less communication per step), then the fewest pipeline stages (less bubble), then
    the least memory."""
    def key(plan: LayoutPlan):
        fits = plan.fits_with(gpu_bytes)
        return (bool(plan.problems), fits is None, RECOMPUTE.index(None if fits in (None, "none") else fits),
                plan.tp * plan.pp, plan.pp, plan.total_bytes[-1] if plan.total_bytes else 0)

    return sorted(plans, key=key)


def describe_misfit(plan: LayoutPlan, gpu_bytes: int) -> str:
    """Why a layout fits under no --recompute-granularity, in words: what takes the memory."""
    state, least = plan.state_bytes / GIB, plan.total_bytes[-1] / GIB
    if state > gpu_bytes / GIB:
        return (f"the weights, gradients and optimizer state alone take {state:.1f} GiB per GPU: more TP x PP or "
                "DP ranks (the distributed optimizer shards its state over DP)")
    return (f"{state:.1f} GiB of state + {least - state:.1f} GiB of activations under full recompute = {least:.1f} "
            "GiB per GPU: a smaller --max-tokens-per-gpu or more TP x PP ranks")
