"""Bounded waits on Ray object refs: every Ray call of slime_sparse goes through these.

A Ray call without a timeout hangs forever when an actor cannot be placed (its bundle's resources are
held by someone else) or a collective waits on a dead peer; every wait here carries a deadline and
says what it was waiting for when it runs out.
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

# Default bound of a Ray wait (seconds). Runs set theirs with --ray-timeout; tests and scripts may
# override it with the environment variable.
DEFAULT_TIMEOUT_S = float(os.environ.get("SLIME_SPARSE_RAY_TIMEOUT_S", "600"))


class ActorDied(RuntimeError):
    """An actor of a group died while serving a call; `index` is its position in the group."""

    def __init__(self, what: str, index: int, cause: BaseException) -> None:
        super().__init__(f"{what}: actor {index} died ({type(cause).__name__}: {cause})")
        self.index = index
        self.cause = cause


def get(ref: Any, what: str, timeout_s: float | None = None) -> Any:
    """ray.get of one ref (or a list of refs) with a deadline; TimeoutError names `what`."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise TimeoutError(f"{what}: no answer from Ray within {timeout_s:.0f} s (--ray-timeout)") from None


def get_each(refs: Sequence[Any], what: str, timeout_s: float | None = None) -> list[Any]:
    """Results of `refs` in order, failing fast: the first actor death raises ActorDied at once.

    A plain ray.get(list) would wait for every ref first, and the survivors of a collective may block
    on the dead peer until the collective's own timeout.
    """
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = sorted(index[r] for r in pending)
            raise TimeoutError(f"{what}: actors {late} did not answer within {timeout_s:.0f} s (--ray-timeout)")
        for ref in ready:
            try:
                results[index[ref]] = ray.get(ref, timeout=timeout_s)
            except RayActorError as exc:
                raise ActorDied(what, index[ref], exc) from exc
    return results

