"""The drift guard's config section (`drift`, flags `--drift-*`, and `--kv-budget-max`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from slime_sparse.flags import flag, non_negative, positive


@dataclass(frozen=True)
class DriftConfig:
    SECTION: ClassVar[str] = "drift"

    probe_interval: int = field(default=10, metadata={"help": (
        "the drift guard: every N rollouts, the first included, the current policy answers held-out probe prompts "
        "twice from the same random streams, densely and under the run's KV settings, and drift/* logs how far "
        "apart the two earn (a warning when the gap is significant twice in a row); 0: off. Only where rollouts "
        "compress")})
    probe_prompts: int = field(default=16, metadata={"help": (
        "probe prompts, each sampled --n-samples-per-prompt times per arm: the first N of --drift-probe-data (else "
        "of the first --eval-prompt-data set), leaving out any that is also a training prompt")})
    probe_data: str = field(default="", metadata={"help": (
        "held-out prompts for the drift guard (jsonl / parquet, --input-key / --label-key as the training data); "
        "empty: the first --eval-prompt-data set. No set: the guard is off, with a warning")})
    budget_max: int | None = field(default=None, metadata={"help": (
        "--kv-budget-schedule drift: the largest budget the guard may raise to (x2 at a time from --kv-budget); "
        "unset: up to a dense cache. The SGLang engine can only run a request dense (its servers keep the budget "
        "they started with), so there the budget moves between --kv-budget and dense and this stays unset")})

    def validate(self) -> None:
        non_negative(self, "probe_interval")
        positive(self, "probe_prompts")
        if self.budget_max is not None:
            positive(self, "budget_max")

    def check_inputs(self) -> None:
        if self.probe_data and not os.path.exists(self.probe_data):
            raise ValueError(f"{flag(self, 'probe_data')} {self.probe_data!r}: file does not exist")
