"""The rollout benchmark's other tables (`rollout_bench.py --same-kv-gib G`, `--count-ops`): sequences that fit in the
same KV memory and their throughput there, dense vs each compression; operations dispatched per decode step and per
compaction.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/<script>.py` from a checkout
    sys.path.insert(0, str(REPO))

from benchmarks.rollout_runs import (COMPRESS_TARGETS, DTYPES, STEP_TARGETS, RowSpec, build_model,  # noqa: E402
                                     compress_targets, compressions, engines_for, make_prompts, median_result,
                                     model_config, our_engine)
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.rollout import SamplingParams  # noqa: E402
from slime_sparse.rollout.embedded import EmbeddedEngine  # noqa: E402

SAME_KV_HEADER = ("| model | prompt | new | KV memory GiB | KV | slots per sequence | sequences that fit | x dense |\n"
                  + "|---" * 8 + "|")


def same_kv_rows(row: RowSpec, args) -> list[str]:
    """How many sequences of this row fit in --same-kv-gib of memory, dense vs each compression, by the engine's own
    count (`kv.engine_memory`: each row's KV and state of `kv.row_capacity` slots, and every working set). A
    compressed sequence holds budget + buffer slots whatever its length, so the ratio grows with the length."""
    from slime_sparse.kv import engine_memory, row_capacity
    from slime_sparse.kv.memory_plan import ModelShape

    cfg = model_config(row.model, args)
    longest = row.prompt_len + row.new_tokens
    lines, dense_fit = [], None
    for kv in [KVCompressConfig()] + compressions(row, args):
        slots = row_capacity(kv, longest)
        cuda = args.device.startswith("cuda")  # the engine's defaults there: graphs, a readback every 8 steps
        spec = engine_memory.EngineSpec(ModelShape.from_hf_config(cfg.to_dict()), kv, slots, slots,
                                        DTYPES[args.dtype].itemsize, graphs=cuda, readback=8 if cuda else 1,
                                        device="cuda" if cuda else "cpu")
        fit = engine_memory.max_rows(spec, int(args.same_kv_gib * 2**30))
        dense_fit = fit if dense_fit is None else dense_fit
        name = "dense" if not kv.enabled else f"{kv.method} B={kv.budget}+{kv.buffer}"
        lines.append(f"| {row.model} | {row.prompt_len} | {row.new_tokens} | {args.same_kv_gib:g} | {name} | {slots} | "
                     f"{fit} | {fit / max(dense_fit, 1):.2f} |")
        print(lines[-1], flush=True)
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Same KV memory, measured: each engine given the same KV GiB decodes as many sequences at once as fit
# ---------------------------------------------------------------------------------------------------------------
SAME_KV_RUN_HEADER = ("| model | prompt | new | KV GiB | KV | sequences that fit | prompts (one wave) | tok/s | x dense "
                      "| compress % | graphs captured in the timed call |\n" + "|---" * 11 + "|")


def same_kv_measured(row: RowSpec, args) -> list[str]:
    """tok/s of this checkout's engine at --same-kv-gib of KV memory, dense vs each compression: each engine admits as
    many rows as fit for its KV config (`kv_cache_gib`) and decodes one full wave of that many prompts (at most
    --same-kv-max-prompts), the steady state of a long rollout at that memory: compression as concurrency.
    Warm-up: a call of --same-kv-warmup-new tokens (default: the row's length); graphs of longer spans are captured
    during the timed call (the captures column counts them)."""
    model = build_model(row.model, row.prompt_len + row.new_tokens + 1, dtype=args.dtype, device=args.device,
                        seed=args.seed, model_dirs=args.model_dirs)
    lines, dense = [], None
    for kv in [KVCompressConfig()] + compressions(row, args):
        run = our_engine(EmbeddedEngine, SamplingParams, model, kv, args, None, kv_cache_gib=args.same_kv_gib)
        fit = run.engine.rows_for(kv, row.prompt_len + row.new_tokens)
        prompts = make_prompts(RowSpec(row.model, min(fit, args.same_kv_max_prompts), row.prompt_len,
                                       row.new_tokens), model.config.vocab_size, args.seed)
        run(prompts, min(args.same_kv_warmup_new or row.new_tokens, row.new_tokens))
        res = median_result([run(prompts, row.new_tokens) for _ in range(args.long_repeats)])
        tps = len(prompts) * row.new_tokens / res.seconds
        dense = dense or tps
        name = "dense" if not kv.enabled else f"{kv.method} B={kv.budget}+{kv.buffer}"
        compress = f"{100 * res.compress_s / res.seconds:.1f}" if kv.enabled else "-"
        lines.append(f"| {row.model} | {row.prompt_len} | {row.new_tokens} | {args.same_kv_gib:g} | {name} | "
                     f"{fit} | {len(prompts)} | {tps:.1f} | {tps / dense:.2f} | {compress} | {res.captures} |")
        print(lines[-1], flush=True)
        del run
    del model
    return lines


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
