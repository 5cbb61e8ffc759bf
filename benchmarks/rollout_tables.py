"""The rollout benchmark's operation counts (`rollout_bench.py --count-ops`): operations dispatched per decode step and
per compaction (the same-memory tables: rollout_memory.py).
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/<script>.py` from a checkout
    sys.path.insert(0, str(REPO))

from benchmarks.rollout_runs import (COMPRESS_TARGETS, STEP_TARGETS, RowSpec, build_model,  # noqa: E402
                                     compress_targets, engines_for, make_prompts)

# ---------------------------------------------------------------------------------------------------------------
# Eager operations per decode step and per compaction: what a GPU's time follows (one kernel launch per op)
# ---------------------------------------------------------------------------------------------------------------
OPS_HEADER = ("| model | batch | engine | KV | ops / decode step | syncs / decode step | compactions | rows / compaction "
              "| ops / compaction | syncs / compaction |\n" + "|---" * 10 + "|")


def op_count_rows(row: RowSpec, args, before: ModuleType | None) -> list[str]:
    """Counts the operations PyTorch dispatches inside the decode step and inside each compaction call (dense vs each
    compression, this checkout and --before), on one generate() of the row. R-KV's redundancy works in blocks sized
    by the device (an L2 cache on CPU, 1 GiB on CUDA): the counts here take CUDA's, whatever --device, since they
    stand for a GPU's kernel launches (both engines: the older one's own CUDA scratch the same way)."""
    from slime_sparse.utils.op_audit import OpCounter

    model = build_model(row.model, row.prompt_len + row.new_tokens + 1, dtype=args.dtype, device=args.device,
                        seed=args.seed, model_dirs=args.model_dirs)
    prompts = make_prompts(row, model.config.vocab_size, args.seed)
    lines = []
    for eng in engines_for(row, model, args, before):
        if eng.label == "hf":
            continue
        engine = eng.run.engine
        counters = {"step": OpCounter(), "compress": OpCounter()}
        calls = {"step": 0, "compress": 0, "rows": 0}
        wrapped = []
        for phase, targets in (("step", STEP_TARGETS), ("compress", COMPRESS_TARGETS)):
            for cls, name in compress_targets(type(engine), targets):
                original = vars(cls)[name]
                wrapped.append((cls, name, original))
                setattr(cls, name, _counted(original, counters[phase], calls, phase))
        try:
            with cuda_scratch(type(engine)):
                eng.run(prompts, row.new_tokens)
        finally:
            for cls, name, original in wrapped:
                setattr(cls, name, original)
        per = lambda phase, what: f"{what / max(calls[phase], 1):.0f}"  # noqa: E731
        step, comp = counters["step"], counters["compress"]
        lines.append(f"| {row.model} | {row.batch} | {eng.label} | {eng.kv_name} | {per('step', step.total)} | "
                     f"{per('step', step.syncs)} | {calls['compress']} | "
                     f"{calls['rows'] / max(calls['compress'], 1):.1f} | {per('compress', comp.total)} | "
                     f"{per('compress', comp.syncs)} |")
        print(lines[-1], flush=True)
    return lines


@contextlib.contextmanager
def cuda_scratch(engine_cls):
    """Scratch sizes of the engine's package as on CUDA, for the length of the block (see op_count_rows)."""
    package = engine_cls.__module__.split(".")[0]
    patched = []
    for module_name, name, value in ((f"{package}.kv.methods.rkv", "DEFAULT_SIM_SCRATCH_BYTES", 1 << 30),
                                     (f"{package}.rollout.embedded.engine", "SCORE_SCRATCH_BYTES",
                                      {False: 1 << 30, True: 1 << 30})):
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, name):
            patched.append((module, name, getattr(module, name)))
            if name == "DEFAULT_SIM_SCRATCH_BYTES":  # the package's own CUDA size where it states one
                value = getattr(module, "SIM_SCRATCH_BYTES", {}).get("cuda", value)
            setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in patched:
            setattr(module, name, value)


def _counted(fn, counter, calls: dict, phase: str):
    """fn run under `counter` (nested calls of the same phase are not counted twice)."""
    def wrapper(*a, **k):
        calls[phase] += 1
        if phase == "compress":
            rows = a[1] if len(a) > 1 else k.get("rows", [])
            calls["rows"] += len(rows)
        with counter:
            return fn(*a, **k)
    wrapper.__wrapped__ = fn
    return wrapper
