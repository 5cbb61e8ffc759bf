"""`--rm-type math_verify`: HuggingFace math-verify (parse + verify).

math-verify bounds its own run time with SIGALRM, which only works on the main thread of the main
interpreter (elsewhere it raises ValueError). We turn those timeouts off (`parsing_timeout=None`,
`timeout_seconds=None`) and bound the time from outside instead: graders run in worker processes that
are killed past `RewardConfig.timeout_s` (see pool.py). This makes the grader callable from any thread.
"""

from __future__ import annotations

import logging
from typing import Any

from slime_sparse.reward.math_grader import label_candidates
from slime_sparse.reward.registry import register_reward


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns "Timeout is disabled ..." when we disable it on purpose; that is not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_LOG_FILTER = _DropTimeoutDisabledWarning()


def _install_log_filter() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _LOG_FILTER not in logger.filters:
            logger.addFilter(_LOG_FILTER)


@register_reward("math_verify")
def grade_math_verify(response: str, label: Any, **kwargs: Any) -> float:
    """1.0 when math-verify finds the response's answer equal to the label (or one of a list of labels).

    The label is wrapped in `\\boxed{}` before parsing (as verl does), so bare labels such as `\\frac{1}{4}`
    or `118` are read as one LaTeX expression. The response is parsed with math-verify's defaults: a boxed
    answer first, else its other LaTeX/expression extraction (which may pick the last number).
    """
    from math_verify import parse, verify  # imported lazily: ~0.3 s, only where this grader is used

    _install_log_filter()
    golds = []
    for truth in label_candidates(label):
        gold = parse(f"\\boxed{{{truth}}}", parsing_timeout=None)
        if gold:
            golds.append(gold)
    if not golds:
        return 0.0
    predicted = parse(response, parsing_timeout=None)
    if not predicted:
        return 0.0
    return 1.0 if any(verify(gold, predicted, timeout_seconds=None) for gold in golds) else 0.0


def _warm_up() -> None:
    """Import math-verify and parse + verify once. A worker does it before it takes answers (see worker.py): on
    a busy machine the first call's imports took longer than a 3 s timeout, so after one hostile answer every
    later one, right answers included, timed out on its fresh worker (found by tests/reward/test_fuzz.py)."""
    grade_math_verify("\\boxed{1}", "1")


grade_math_verify.warm_up = _warm_up  # type: ignore[attr-defined]
