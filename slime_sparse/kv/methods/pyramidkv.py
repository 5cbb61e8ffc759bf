"""PyramidKV: SnapKV's scores under per-layer budgets that shrink with depth."""
from __future__ import annotations

from dataclasses import dataclass

from .base import bad_knob, knob, register
from .snapkv import SnapKV


@register
@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., arXiv 2406.02069): SnapKV's scores under per-layer budgets that shrink with depth
    (`kv/budgets.py` computes them from `pyramid_beta`)."""

    name = "pyramidkv"
    default_schedule = "pyramid"

    pyramid_beta: float = knob(10.0, (
        "PyramidKV's beta: the last layer keeps 1/beta of the mean selectable budget (--kv-budget minus window and "
        "sinks), the first twice that mean minus it"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pyramid_beta < 1:
            raise bad_knob("pyramid_beta", self.pyramid_beta, "must be >= 1")
