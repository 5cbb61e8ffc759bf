"""Entry point of one grader process, started by GraderPool:

    python -m slime_sparse.reward.worker --fd FD --grader module:qualname

FD is this end of a socket pair to the parent. Protocol (pickled messages through
multiprocessing.connection): the worker first sends ("ready", None) or ("init_error", text); then for each
(task_id, response, label, kwargs) it receives, it answers (task_id, "ok", reward) or
(task_id, "error", text); None, or the parent going away, ends it.

Not imported by the package (running a module with -m that the package already imported would load it
twice); the shared helpers live in pool.py.
"""

from __future__ import annotations

import argparse
import signal
from multiprocessing.connection import Connection

from slime_sparse.reward.pool import ERROR, OK, as_reward, describe_exception, resolve_reference


def serve(conn: Connection, reference: str) -> None:
    try:
        grader = resolve_reference(reference)
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
            conn.send((task_id, ERROR, describe_exception(exc)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="file descriptor of the socket to the parent")
    parser.add_argument("--grader", required=True, help="module:qualname of the grader function")
    args = parser.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group: let the parent decide when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(args.fd)
    try:
        serve(conn, args.grader)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
