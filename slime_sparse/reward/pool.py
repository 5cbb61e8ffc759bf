"""A small persistent pool of grader processes with a per-call timeout.

Why not concurrent.futures / multiprocessing.Pool: neither can stop one call that hangs (sympy on an
adversarial answer can run for minutes, and a C-level loop ignores Python-level interrupts). Here each
worker grades one response at a time over its own socket; a call past its deadline gets its worker killed
and replaced, and scores 0 as a timeout. A grader that raises scores 0 as an error; a worker that dies
mid-call (segfault, os._exit) scores 0 as an error and is replaced. Nothing propagates to the caller.

Workers are fresh interpreters (`python -m slime_sparse.reward.worker`, see worker.py), not forks: the
trainer process may hold threads and a CUDA context that forking would duplicate, and unlike
multiprocessing's "spawn" nothing re-imports the caller's `__main__` script. A worker receives the grader
as a `module:qualname` reference and imports it, with the parent's sys.path: graders must be module-level
functions of importable modules (not of the `__main__` script). A grader may carry a `warm_up()` attribute
(lazy imports to do once): each worker runs it before it reports ready, outside every call's timeout.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

OK, ERROR, TIMEOUT = "ok", "error", "timeout"

# A worker that has not imported its grader after this long is broken (not merely slow): fail loudly.
STARTUP_TIMEOUT_S = 120.0
_MAX_MESSAGE_CHARS = 500


@dataclass(frozen=True)
class GradeOutcome:
    """Result of one grader call: status is "ok", "error" or "timeout"; reward is 0.0 unless ok.
    message: what went wrong, one line; traceback: the grader's traceback when it raised."""

    status: str
    reward: float = 0.0
    message: str = ""
    traceback: str = ""


def grader_reference(fn: Callable) -> str:
    """`module:qualname` of a module-level function; ValueError if a worker could not import it back."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:  # <lambda>, <locals>
        raise ValueError(
            f"reward grader {fn!r} must be a module-level function to run in worker processes "
            "(lambdas and nested functions cannot be imported by a worker); or use num_workers=0"
        )
    if module == "__main__":
        raise ValueError(
            f"reward grader {qualname} is defined in the __main__ script, which worker processes cannot import; "
            "move it to a module (or use num_workers=0)"
        )
    reference = f"{module}:{qualname}"
    try:
        resolved = resolve_reference(reference)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward grader {reference} cannot be imported back by name: {exc}") from exc
    if resolved is not fn:
        raise ValueError(f"reward grader {reference} resolves to a different object than the one given")
    return reference


def resolve_reference(reference: str) -> Callable:
    """Import `module:qualname` (qualname may be dotted, e.g. a staticmethod)."""
    module_name, _, qualname = reference.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def as_reward(value: Any) -> float:
    """A grader's return value as a finite float (bools and ints accepted); TypeError/ValueError otherwise."""
    if not isinstance(value, (bool, int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"a reward grader must return a number, got {type(value).__name__}")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"a reward grader returned a non-finite value {reward}")
    return reward


def describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:_MAX_MESSAGE_CHARS]


class _Worker:
    """Parent-side handle of one worker process."""

    def __init__(self, process: subprocess.Popen, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.started_at = time.monotonic()
        self.ready = False
        self.task_id: int | None = None  # the task in flight, if any
        self.task_index: int | None = None  # its position in the current batch
        self.deadline = math.inf

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return None

    def request_exit(self) -> None:
        """Ask an idle worker to leave its loop (no wait)."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass  # already gone

    def stop(self, grace_s: float = 0.0) -> None:
        """Wait up to `grace_s` for the process to exit, then kill it (SIGKILL also stops C-level hangs)."""
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    """Finalizer (close(), garbage collection, interpreter exit): must not reference the pool itself.

    Idle workers are asked to exit and given a moment; busy or still-starting ones are killed (graders
    keep no state worth a graceful exit, and a busy one may be hung).
    """
    idle = [worker.ready and worker.task_id is None for worker in workers]
    for worker, is_idle in zip(workers, idle, strict=True):
        if is_idle:
            worker.request_exit()
    for worker, is_idle in zip(workers, idle, strict=True):
        worker.stop(grace_s=0.5 if is_idle else 0.0)
    workers.clear()


class GraderPool:
    """`num_workers` processes running `grader(response, label, **kwargs)`, each call bounded by `timeout_s`."""

    def __init__(self, grader: Callable, num_workers: int, timeout_s: float, memory_limit_mb: int = 0) -> None:
        """memory_limit_mb: cap of each worker's data segment (0: none); see worker.py."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 for a process pool, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.reference = grader_reference(grader)
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = int(memory_limit_mb)
        self._task_ids = itertools.count()
        self._lock = threading.Lock()  # one batch at a time; callers may be on any thread
        self._workers: list[_Worker] = [self._start_worker() for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # -- lifecycle ------------------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        # The worker imports what we can import: our sys.path ("" meaning the current directory).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path or os.getcwd() for path in sys.path))
        fd = child_sock.fileno()
        process = subprocess.Popen(
            [sys.executable, "-m", "slime_sparse.reward.worker", "--fd", str(fd), "--grader", self.reference,
             "--memory-limit-mb", str(self.memory_limit_mb)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child_sock.close()  # so that the worker's death reads as EOF on our end
        return _Worker(process, Connection(parent_sock.detach()))

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop()
        self._workers[slot] = self._start_worker()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def worker_pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers]

    def wait_until_ready(self) -> None:
        """Block until every worker has imported its grader (RuntimeError if one cannot).

        Optional: grade() uses workers as they come up. Call it to surface a broken grader import at
        start-up, or before timing-sensitive work.
        """
        with self._lock:
            if self.closed:
                raise RuntimeError("GraderPool.wait_until_ready called after close()")
            while not all(worker.ready for worker in self._workers):
                self._collect([])

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        with self._lock:
            self._finalizer()

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- grading --------------------------------------------------------------------------------------

    def grade(self, tasks: Sequence[tuple[str, Any, dict[str, Any]]]) -> list[GradeOutcome]:
        """Grade (response, label, kwargs) tasks across the workers; one outcome per task, in order."""
        with self._lock:
            if self.closed:
                raise RuntimeError("GraderPool.grade called after close()")
            # A batch interrupted earlier (e.g. KeyboardInterrupt) may have left calls in flight.
            for slot, worker in enumerate(self._workers):
                if worker.task_id is not None:
                    self._replace(slot)
            outcomes: list[GradeOutcome | None] = [None] * len(tasks)
            pending = deque(range(len(tasks)))
            while pending or any(w.task_id is not None for w in self._workers):
                self._dispatch(tasks, pending, outcomes)
                self._collect(outcomes)
            assert all(outcome is not None for outcome in outcomes)
            return outcomes  # type: ignore[return-value]

    def _dispatch(self, tasks: Sequence, pending: deque, outcomes: list) -> None:
        for slot, worker in enumerate(self._workers):
            while pending and worker.ready and worker.task_id is None:
                index = pending.popleft()
                task_id = next(self._task_ids)
                try:
                    worker.conn.send((task_id, *tasks[index]))
                except (BrokenPipeError, ConnectionResetError):
                    pending.appendleft(index)  # the idle worker had died: retry on its replacement
                    self._replace(slot)
                    break
                except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable label
                    outcomes[index] = GradeOutcome(ERROR, 0.0, f"cannot send task to worker: {describe_exception(exc)}")
                    continue
                worker.task_id, worker.task_index = task_id, index
                worker.deadline = time.monotonic() + self.timeout_s

    def _collect(self, outcomes: list) -> None:
        """Wait for the next message or deadline; record results, timeouts and crashes."""
        watched = [w for w in self._workers if w.task_id is not None or not w.ready]
        if not watched:
            return
        now = time.monotonic()
        next_deadline = min(
            [w.deadline for w in watched if w.task_id is not None]
            + [w.started_at + STARTUP_TIMEOUT_S for w in watched if not w.ready]
        )
        for conn in wait([w.conn for w in watched], timeout=max(0.0, next_deadline - now)):
            slot = next(i for i, w in enumerate(self._workers) if w.conn is conn)
            self._receive(slot, outcomes)
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker.task_id is not None and now >= worker.deadline:
                outcomes[worker.task_index] = GradeOutcome(TIMEOUT, 0.0, f"grader exceeded {self.timeout_s:g} s")
                self._replace(slot)
            elif not worker.ready and now >= worker.started_at + STARTUP_TIMEOUT_S:
                raise RuntimeError(f"reward worker for {self.reference} did not start within {STARTUP_TIMEOUT_S:g} s")

    def _receive(self, slot: int, outcomes: list) -> None:
        worker = self._workers[slot]
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            exit_code = worker.exit_code()
            if not worker.ready:
                raise RuntimeError(
                    f"reward worker for {self.reference} exited during start-up (exit code {exit_code}); "
                    "see its stderr"
                ) from None
            outcomes[worker.task_index] = GradeOutcome(ERROR, 0.0, f"worker process died (exit code {exit_code})")
            self._replace(slot)
            return
        if not worker.ready:
            kind, detail = message
            if kind != "ready":
                raise RuntimeError(f"reward worker cannot load grader {self.reference}: {detail}")
            worker.ready = True
            return
        task_id, status, payload = message
        if task_id != worker.task_id:
            return  # stale answer to a task from an interrupted batch
        if status == OK:
            outcomes[worker.task_index] = GradeOutcome(OK, payload)
        else:
            text, trace = payload
            outcomes[worker.task_index] = GradeOutcome(status, 0.0, text, trace)
        worker.task_id = worker.task_index = None
        worker.deadline = math.inf
