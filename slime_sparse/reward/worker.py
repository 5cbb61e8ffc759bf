"""Entry point of one grader process, started by GraderPool:

    python -m slime_sparse.reward.worker --fd FD --grader module:qualname [--memory-limit-mb N]

FD is this end of a socket pair to the parent. Protocol (pickled messages through
multiprocessing.connection): the worker imports the grader, runs its `warm_up()` attribute if it has one (lazy
imports, a parser to build: seconds on a busy machine, which must not count against the first answer's
timeout, nor against every answer after a timeout, each graded by a fresh worker), and sends ("ready", None)
or ("init_error", text); then for each
(task_id, response, label, kwargs) it receives, it answers (task_id, "ok", reward) or
(task_id, "error", (text, traceback)); None, or the parent going away, ends it.

--memory-limit-mb caps the worker's data segment (RLIMIT_DATA: heap and anonymous memory, not shared
libraries or reserved address space): a grader that tries to build a gigantic number raises MemoryError
(an error outcome) instead of taking the machine's memory. A watchdog thread exits the worker when its
parent dies (kill -9 of the trainer) even while a grader is stuck in a long call.

Not imported by the package (running a module with -m that the package already imported would load it
twice); the shared helpers live in pool.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

from slime_sparse.reward.pool import ERROR, OK, as_reward, describe_exception, resolve_reference

_MAX_TRACEBACK_CHARS = 8000


def serve(conn: Connection, reference: str) -> None:
    try:
        grader = resolve_reference(reference)
        warm_up = getattr(grader, "warm_up", None)
        if warm_up is not None:
            warm_up()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("init_error", describe_exception(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if task is None:
            return
        task_id, response, label, kwargs = task
        try:
            conn.send((task_id, OK, as_reward(grader(response, label, **kwargs))))
        except Exception as exc:  # noqa: BLE001 - a failing grader is an outcome, not a crash
            conn.send((task_id, ERROR, (describe_exception(exc), traceback.format_exc()[-_MAX_TRACEBACK_CHARS:])))


def limit_memory(megabytes: int) -> None:
    import resource

    limit = megabytes * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit this process once its parent is gone (re-parented), checked every `poll_s` seconds.

    Needed when the parent dies without closing the socket's far end properly for us to notice, i.e. while
    a grader is busy: a hung sympy call would otherwise outlive a kill -9 of the trainer. A call that holds
    the GIL for its whole duration (one huge C-level operation) delays the exit until it returns."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="file descriptor of the socket to the parent")
    parser.add_argument("--grader", required=True, help="module:qualname of the grader function")
    parser.add_argument("--memory-limit-mb", type=int, default=0, help="cap of the data segment (0: none)")
    args = parser.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group: let the parent decide when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    if args.memory_limit_mb:
        limit_memory(args.memory_limit_mb)
    conn = Connection(args.fd)
    try:
        serve(conn, args.grader)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
