"""Fault injection for chaos tests: named points where a process kills itself (SIGKILL) on request.

    SLIME_SPARSE_FAULT=checkpoint.staged@2 SLIME_SPARSE_FAULT_RECORD=/tmp/faults slime-sparse-train ...

kills the run with SIGKILL (a real kill -9: no cleanup, no atexit, no flush of Python buffers) the 2nd
time it reaches `fault_point("checkpoint.staged")`. Just before, it writes the record file
`/tmp/faults/checkpoint.staged@2.json`: point, hit, pid and call stack, so the chaos driver knows where
the kill landed. An existing record file disarms the fault: it fires once even across processes that
restart with the same environment (Ray actors). Several faults: `engine.step@40,metrics.write@2` (hits
are counted per process: in a Ray run an engine actor and the driver each count their own).
`SLIME_SPARSE_FAULT_TRACE=<file>` appends each point's name when it differs from the previous one, so a kill
sent from outside at a random moment can be attributed to the last point passed, and at a normal exit
appends how often each point was reached (`<pid> counts {json}`), so a driver can size its hits.

The points (each a place where a crash must lose nothing):
    engine.step         the embedded engine, before each model forward of generate() (prefill chunk or decode step)
    learner.backward    the embedded learner, after a micro-batch's backward, before the optimizer step
    checkpoint.staged   every checkpoint file written into tmp-<name>, before trainer_state.json marks it complete
    checkpoint.renamed  the checkpoint moved into place, before `latest` points at it
    checkpoint.prune    an old checkpoint renamed to tmp-deleting-*, before it is deleted
    metrics.write       half of a metrics.jsonl line written and flushed (a torn line), before the rest

Unset (the normal case) a point costs a global lookup. The environment is read at import; tests that
set it later call `configure()`.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import traceback
from typing import Callable

FAULT_ENV = "SLIME_SPARSE_FAULT"
RECORD_ENV = "SLIME_SPARSE_FAULT_RECORD"
TRACE_ENV = "SLIME_SPARSE_FAULT_TRACE"
POINTS = ("engine.step", "learner.backward", "checkpoint.staged", "checkpoint.renamed", "checkpoint.prune",
          "metrics.write")

_armed: dict[str, int] = {}  # point -> hit
_record: str | None = None
_trace: str | None = None
_last_traced: str | None = None
_hits: dict[str, int] = {}


def parse_faults(spec: str) -> dict[str, int]:
    """"point@hit,point@hit" -> {point: hit}; ValueError naming the variable otherwise."""
    armed = {}
    for item in filter(None, spec.split(",")):
        point, sep, hit = item.strip().partition("@")
        if point not in POINTS or not sep or not hit.isdigit() or int(hit) < 1 or point in armed:
            raise ValueError(f"{FAULT_ENV}={spec!r} must be 'point@hit[,point@hit]' with hit >= 1 and each point "
                             f"once, one of {POINTS}")
        armed[point] = int(hit)
    return armed


def configure(environ: dict | None = None) -> None:
    """(Re-)read the fault settings from `environ` (default os.environ) and reset the hit counters."""
    global _armed, _record, _trace, _last_traced
    env = os.environ if environ is None else environ
    _armed = parse_faults(env.get(FAULT_ENV, ""))
    _record = env.get(RECORD_ENV) or None
    if _armed and _record is None:
        raise ValueError(f"{FAULT_ENV} needs {RECORD_ENV} (where the fault says it fired)")
    _trace = env.get(TRACE_ENV) or None
    _last_traced = None
    _hits.clear()


def fault_point(name: str, before_kill: Callable[[], None] | None = None) -> None:
    """Reached `name`: die here if this is the armed point's armed hit. `before_kill` runs first (e.g. to
    leave a half-written line behind)."""
    if not _armed and _trace is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _trace is not None:
        _trace_point(name)
    if name not in _armed:
        return
    if _hits[name] != _armed[name]:
        return
    os.makedirs(_record, exist_ok=True)
    try:  # exclusive create: only the first process to get here fires, and only once
        fd = os.open(os.path.join(_record, f"{name}@{_armed[name]}.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    if before_kill is not None:
        before_kill()
    stack = [frame.name for frame in traceback.extract_stack()[:-1]]
    os.write(fd, json.dumps({"point": name, "hit": _hits[name], "pid": os.getpid(), "stack": stack}).encode())
    os.fsync(fd)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def _write_counts() -> None:
    if _trace is not None and _hits:
        with open(_trace, "a", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()} counts {json.dumps(_hits)}\n")


def _trace_point(name: str) -> None:
    global _last_traced
    if name == _last_traced:
        return
    _last_traced = name
    with open(_trace, "a", encoding="utf-8") as fh:  # closed at once: the kernel has it when we are killed
        fh.write(f"{os.getpid()} {name}\n")


configure()
atexit.register(_write_counts)
