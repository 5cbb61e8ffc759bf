"""Batch reward function: the object the training loop calls once per rollout batch."""

from __future__ import annotations

import logging
import signal
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from slime_sparse.reward.config import RewardConfig
from slime_sparse.reward.pool import ERROR, OK, TIMEOUT, GradeOutcome, GraderPool, as_reward, describe_exception

logger = logging.getLogger(__name__)

# responses, labels -> (one reward per response, counters of this call)
RewardFn = Callable[[list[str], list], tuple[list[float], dict[str, int]]]


class RewardFailure(RuntimeError):
    """More than --rm-max-error-rate of one batch's rewards failed: the grader (or its setup) is broken, and a run
    on zero rewards would train on nothing. The message holds the first failure's traceback."""


class _InlineTimeout(BaseException):
    """--rm-timeout expired in an inline grader call (a BaseException: the grader's `except Exception` cannot
    swallow it)."""


@dataclass
class RewardStats:
    """Counters of grader calls.

    graded: calls that returned a reward (correct or not); errors: calls that raised, returned a
    non-number, or whose worker died; timeouts: calls killed past the timeout. Errors and timeouts score 0.
    """

    graded: int = 0
    errors: int = 0
    timeouts: int = 0

    def add(self, other: RewardStats) -> None:
        self.graded += other.graded
        self.errors += other.errors
        self.timeouts += other.timeouts

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class RewardFunction:
    """Scores batches of responses with the grader a RewardConfig selects.

    Usage:
        with get_reward_fn(RewardConfig(rm_type="math")) as reward_fn:
            rewards, counters = reward_fn(responses, labels)

    `extras` (optional, one dict per response) is passed to the grader as keyword arguments. `stats`
    accumulates the counters over every call; each call returns its own (the loop logs them per rollout as
    reward/graded, reward/errors, reward/timeouts). A failure is logged once per kind (the exception's type,
    or a timeout, or a dead worker), the first time it happens, with the grader's traceback; later ones are
    only counted. Worker processes stop on close(), on leaving the `with` block, when the object is
    garbage-collected, or at interpreter exit.
    """

    def __init__(self, config: RewardConfig) -> None:
        config.validate()
        self.config = config
        self.grader = config.resolve_grader()
        self.stats = RewardStats()
        self._reported: set[str] = set()  # failure kinds already logged
        self._pool = (GraderPool(self.grader, config.num_workers, config.timeout_s, config.memory_limit_mb)
                      if config.num_workers > 0 else None)

    def __call__(
        self, responses: Sequence[str], labels: Sequence[Any], extras: Sequence[dict[str, Any]] | None = None
    ) -> tuple[list[float], dict[str, int]]:
        if len(responses) != len(labels):
            raise ValueError(f"reward: got {len(responses)} responses but {len(labels)} labels")
        if extras is not None and len(extras) != len(responses):
            raise ValueError(f"reward: got {len(extras)} extras for {len(responses)} responses")
        kwargs = [dict(extra) for extra in extras] if extras is not None else [{} for _ in responses]
        tasks = list(zip(responses, labels, kwargs, strict=True))
        if self._pool is not None:
            outcomes = self._pool.grade(tasks)
        else:
            if threading.current_thread() is not threading.main_thread():  # where SIGALRM cannot reach
                raise RuntimeError("--rm-num-workers 0 grades in the calling thread and can enforce --rm-timeout "
                                   "only on the main thread: use --rm-num-workers >= 1")
            outcomes = [self._grade_inline(*task) for task in tasks]

        batch = RewardStats(
            graded=sum(o.status == OK for o in outcomes),
            errors=sum(o.status == ERROR for o in outcomes),
            timeouts=sum(o.status == TIMEOUT for o in outcomes),
        )
        self.stats.add(batch)
        self._log_failures(outcomes)
        self._check_error_rate(outcomes)
        return [o.reward for o in outcomes], batch.as_dict()

    def _grade_inline(self, response: str, label: Any, kwargs: dict[str, Any]) -> GradeOutcome:
        """num_workers=0: grade in the calling thread (errors are caught; the timeout is a SIGALRM timer)."""
        try:
            with _time_limit(self.config.timeout_s):
                reward = as_reward(self.grader(response, label, **kwargs))
            return GradeOutcome(OK, reward)
        except _InlineTimeout:
            return GradeOutcome(TIMEOUT, 0.0, f"grader exceeded {self.config.timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - a failing grader scores 0, it does not stop training
            return GradeOutcome(ERROR, 0.0, describe_exception(exc), traceback.format_exc())

    def _check_error_rate(self, outcomes: list[GradeOutcome]) -> None:
        failed = [o for o in outcomes if o.status != OK]
        if not outcomes or len(failed) <= self.config.max_error_rate * len(outcomes):
            return
        first = next((o for o in failed if o.traceback), failed[0])
        errors = sum(o.status == ERROR for o in failed)
        raise RewardFailure(
            f"reward: {len(failed)} of {len(outcomes)} rewards of this batch failed ({errors} errors, "
            f"{len(failed) - errors} timeouts), more than --rm-max-error-rate {self.config.max_error_rate:g}; the "
            f"grader {getattr(self.grader, '__qualname__', self.grader)} is broken or too slow for --rm-timeout "
            f"{self.config.timeout_s:g}. The first failure: {first.message}\n{first.traceback.rstrip()}".rstrip())

    def _log_failures(self, outcomes: list[GradeOutcome]) -> None:
        """Log the first failure of each kind with its traceback; later ones of that kind are only counted."""
        for outcome in outcomes:
            if outcome.status == OK:
                continue
            kind = outcome.status if outcome.status == TIMEOUT else outcome.message.split(":", 1)[0]
            if kind in self._reported:
                continue
            self._reported.add(kind)
            counter = "reward/timeouts" if outcome.status == TIMEOUT else "reward/errors"
            hint = ""
            if kind == "MemoryError" and self.config.memory_limit_mb:
                hint = f" (workers are capped at --rm-memory-limit-mb={self.config.memory_limit_mb})"
            logger.warning(
                "reward: grader %s: %s%s; the response scores 0. Later failures of this kind are only counted "
                "(%s in metrics.jsonl).%s",
                getattr(self.grader, "__qualname__", self.grader), outcome.message, hint, counter,
                f"\n{outcome.traceback.rstrip()}" if outcome.traceback else "",
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardFunction:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _InlineTimeout in this (main) thread after `seconds`: SIGALRM is the one way to stop a Python call
    without a second process. Python code is interrupted between bytecodes; one long C call is not."""
    def expire(_signum: int, _frame: Any) -> None:
        raise _InlineTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def get_reward_fn(config: RewardConfig) -> RewardFunction:
    """Validate `config` and build its reward function (starting its worker processes)."""
    return RewardFunction(config)
