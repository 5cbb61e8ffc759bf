"""Rollout throughput of the embedded engine against HF generate() (and the engine of an older commit), one process.

Each row decodes one batch of random prompts for exactly N new tokens (EOS ignored, so every engine does the
same work) with each engine in turn, interleaved: hf, before, after, hf, before, after, ... and reports medians.
Engines: `hf` = transformers' generate() (dense DynamicCache, multinomial sampling), `after` = this checkout's
EmbeddedEngine, `before` = the EmbeddedEngine of commit --before (extracted from git into a temporary package and
imported beside ours, so both run on the same model object under the same load). Every engine runs dense; ours
also under each --methods x --budgets compression that the row's length reaches.

Columns: tokens/s (new tokens of the batch / wall time of the call), its ratio to hf and to before (same row,
same KV config), peak KV memory (hf: its final cache; ours: the preallocated cache, never exceeded), compression
time as a share of the call, the roofline fraction (time the call would take if every forward only read the
weights and the KV it held once, at the copy bandwidth measured at start, over the measured time), prefill
tokens saved by sharing a prompt's prefill across its n samples, whether `after` drew the same tokens as
`before` (same seed), and the CUDA graphs captured during the timed calls (0: warm; every engine is warmed by a call
of the row's own length unless --long-warmup-new says otherwise).
--same-memory-gib G: throughput at the same total device memory, dense vs each compression, a fixed-length wave and a
length mix (rollout_memory.py). --json FILE: every table row also as a JSON line (tools/gpu_summary.py reads them).
Every table is stamped with the machine that made it.

    python benchmarks/rollout_bench.py --quick --before 8401d90        # ~3 min on an idle 2-core machine
    python benchmarks/rollout_bench.py --before 8401d90                # the table of benchmarks/README.md
    python benchmarks/rollout_bench.py --rows smollm2-135m:8:128:256 --model smollm2-135m=/path/to/hf_dir
    python benchmarks/rollout_bench.py --device cuda --dtype bfloat16 --rows qwen2-19m:64:128:1024 qwen2-19m:64:128:4096
    python benchmarks/rollout_bench.py --suite gpu-43 --device cuda --dtype bfloat16 --same-memory-gib 24   # #43

A row is MODEL:BATCH:PROMPT:NEW[:N]: BATCH sequences = BATCH / N distinct prompts x N samples (GRPO groups).
MODEL is a preset (config-built, random weights: timings do not depend on weight values) or NAME=DIR for a local
HF directory (e.g. SmolLM2-135M-Instruct built by #14's `tools/gguf_to_hf.py`), then used as NAME in rows.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/<script>.py` from a checkout
    sys.path.insert(0, str(REPO))

import benchmarks.rollout_runs as runs  # noqa: E402
from benchmarks.rollout_memory import (FIT_HEADER, RUN_HEADER, fit_rows, format_fit, format_run,  # noqa: E402
                                       measured_rows)
from benchmarks.rollout_runs import (CLOCKS, DTYPES, PRESETS, Engine, Result, RowSpec, build_model,  # noqa: E402
                                     engines_for, kv_bytes_per_token, load_before, machine, make_prompts,
                                     measure_bandwidth, median_result, weight_bytes)
from benchmarks.rollout_tables import OPS_HEADER, op_count_rows  # noqa: E402
from slime_sparse.kv import METHODS  # noqa: E402

SUITES: dict[str, list[str]] = {
    "ci": ["tiny:4:24:40", "tiny:4:24:40:2"],
    # one H100 / H200, bf16: batch 64 at 128 new tokens (warm HF, dense, R-KV at a tight 64 + 32). gpu-43: #43's rows
    # at the same batch (tools/gpu_checks.sh, profile targets, with --same-memory-gib 24 and GPU_SAME_MEMORY): batch 64
    # at 128 new tokens, then 256 at 4096, dense vs R-KV 512 + 128 (about 4 minutes at 2026-11's speeds). gpu-extra: the
    # rest
    "gpu": ["qwen2.5-1.5b:64:128:128@64+32"],
    "gpu-43": ["qwen2.5-1.5b:64:128:128", "qwen2.5-1.5b:256:128:4096"],
    "gpu-extra": ["qwen2.5-1.5b:256:128:4096", "qwen2.5-1.5b:64:128:4096", "qwen2.5-1.5b:64:128:1024",
                  "qwen2.5-1.5b:256:128:1024"],
    "quick": ["qwen2-19m:8:64:256", "qwen2-19m:8:64:1024", "qwen2-19m:32:512:256:8"],
    "full": ["qwen2-19m:8:64:256", "qwen2-19m:8:64:1024", "qwen2-19m:8:64:4096", "qwen2-19m:32:64:256",
             "qwen2-19m:64:64:256", "qwen2-19m:32:512:256:8", "smollm2-135m:8:128:256"],
}
GPU_SAME_MEMORY = ["qwen2.5-1.5b:1:128:4096"]  # #43's same-total-memory row (the batch is what fits)
SUITE_KV = {"ci": ([16], 8), "quick": ([512], 128), "full": ([512], 128), "gpu": ([512], 128),
            "gpu-43": ([512], 128), "gpu-extra": ([512], 128)}  # (budgets, buffer)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick suite (see SUITES)")
    p.add_argument("--suite", choices=sorted(SUITES), default=None, help="a named set of rows (default: full)")
    p.add_argument("--rows", nargs="+", default=None, help="MODEL:BATCH:PROMPT:NEW[:N] rows instead of a suite")
    p.add_argument("--model", action="append", default=[], metavar="NAME=DIR", help="a local HF directory as NAME")
    p.add_argument("--before", default=None, metavar="REV", help="also time the engine of this git commit")
    p.add_argument("--methods", nargs="*", default=["rkv"], choices=[m for m in METHODS if m != "none"])
    p.add_argument("--budgets", type=int, nargs="+", default=None, help="KV budgets (default: the suite's)")
    p.add_argument("--buffer", type=int, default=None, help="KV buffer (default: the suite's)")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per row (medians reported)")
    p.add_argument("--long-repeats", type=int, default=1, help="repetitions for rows of >= 2048 new tokens")
    p.add_argument("--long-warmup-new", type=int, default=10**9,
                   help="new tokens of the warm-up of our engines on rows of >= 2048 new tokens (default: the row's)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate() baseline")
    p.add_argument("--hf-max-new", type=int, default=None,
                   help="run HF generate() only on rows of at most this many new tokens (it is the slow baseline)")
    p.add_argument("--step-modes", nargs="+", default=[], choices=["eager", "compile", "cuda_graph"],
                   help="also run this checkout's engine with these decode step modes (columns after+MODE; plain "
                        "`after` is the engine's default mode on the device)")
    p.add_argument("--same-memory-gib", type=float, default=None,
                   help="also the tables at the same total device memory (rollout_memory.py): each config's engine "
                        "given --rollout-kv-cache-gib this much alone, admitting what fits; how many sequences fit, "
                        "then the tok/s of a fixed-length wave and of a length mix: the headline table")
    p.add_argument("--same-memory-max-prompts", type=int, default=512,
                   help="at most this many sequences in the fixed-length wave (each config decodes one wave of its fit)")
    p.add_argument("--mix-prompts", type=int, default=512,
                   help="sequences of the length mix, the same for every config (a rollout's batch: 64 x 8)")
    p.add_argument("--mix-mean-new", type=int, default=None,
                   help="mean response length of the length mix (geometric, capped at the row's; default: a third)")
    p.add_argument("--same-memory-rows", nargs="+", default=None, metavar="ROW",
                   help="rows of the same-memory tables (MODEL:BATCH:PROMPT:NEW[@B+BUFFER]; BATCH unused: what fits "
                        "decodes); default: the suite's rows (--suite gpu / gpu-43: GPU_SAME_MEMORY)")
    p.add_argument("--same-memory-only", action="store_true", help="only the same-memory tables (no per-batch rows)")
    p.add_argument("--same-memory-fit-only", action="store_true",
                   help="of the same-memory tables, only what fits (the engine's admission; no model is run)")
    p.add_argument("--json", default=None, metavar="FILE", help="also append every table row here as a JSON line")
    p.add_argument("--count-ops", action="store_true",
                   help="also count the operations dispatched per decode step and per compaction (dense vs each "
                        "compression, after vs before): the number a GPU's time follows")
    p.add_argument("--max-kv-gib", type=float, default=3.0, help="skip a dense engine whose KV would exceed this")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1 by default: steady on a CPU shared with other jobs)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="cpu = this process's CPU time: steadier than wall time on a machine shared with other jobs "
                        "(with --threads 1; meaningless on GPU)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.rows_given = bool(args.rows)
    if args.rows and (args.suite or args.quick):
        p.error("give either --rows or a suite (--suite / --quick)")
    suite = "quick" if args.quick else (args.suite or "full")
    args.rows = [RowSpec.parse(r) for r in (args.rows or SUITES[suite])]
    same = [RowSpec.parse(r) for r in args.same_memory_rows] if args.same_memory_rows else (
        [RowSpec.parse(r) for r in GPU_SAME_MEMORY] if suite.startswith("gpu") and not args.rows_given else args.rows)
    # the batch is what fits: rows that differ only in their batch are one row here
    args.same_memory_rows = list({(r.model, r.prompt_len, r.new_tokens, r.kv): r for r in same}.values())
    args.budgets = args.budgets or SUITE_KV[suite][0]
    args.buffer = args.buffer or SUITE_KV[suite][1]
    args.model_dirs = {}
    for item in args.model:
        name, sep, path = item.partition("=")
        if not sep or not os.path.isdir(path):
            p.error(f"--model {item!r}: expected NAME=DIR with an existing local HF directory")
        args.model_dirs[name] = path
    unknown = sorted({r.model for r in args.rows} - set(PRESETS) - set(args.model_dirs))
    if unknown:
        p.error(f"unknown model(s) {unknown}: presets are {sorted(PRESETS)}, or pass --model NAME=DIR")
    for name in ("repeats", "long_repeats", "buffer", "window", "threads", "same_memory_max_prompts", "mix_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------------------------
HEADER = ("| model | batch | prompt | new | engine | KV | tok/s | x hf | x before | peak KV MiB | compress % "
          "| roofline % | prefill saved | = before | captures |\n" + "|---" * 15 + "|")


def format_row(row: RowSpec, eng: Engine, res: Result, hf: Result | None, before: Result | None,
               roofline_s: float) -> str:
    tps = row.batch * row.new_tokens / res.seconds
    ratio = lambda base: "-" if base is None or base is res else f"{base.seconds / res.seconds:.2f}"  # noqa: E731
    same = "-"
    if before is not None and eng.label == "after":
        differ = sum(a != b for a, b in zip(res.tokens, before.tokens))
        same = "yes" if differ == 0 else f"no ({differ}/{len(res.tokens)} differ)"
    batch = f"{row.batch // row.n_samples}x{row.n_samples}" if row.n_samples > 1 else str(row.batch)
    compress = f"{100 * res.compress_s / res.seconds:.1f}" if eng.kv.enabled else "-"
    saved = str(res.prefill_saved) if eng.label != "hf" else "-"
    return (f"| {row.model} | {batch} | {row.prompt_len} | {row.new_tokens} | {eng.label} | {eng.kv_name} | "
            f"{tps:.1f} | {ratio(hf)} | {ratio(before)} | {res.kv_bytes / 2**20:.1f} | {compress} | "
            f"{100 * roofline_s / res.seconds:.1f} | {saved} | {same} | {res.captures if eng.label != 'hf' else '-'} |")


def run_row(row: RowSpec, args, before: ModuleType | None, bandwidth: float) -> list[str]:
    model = build_model(row.model, row.prompt_len + row.new_tokens + 1, dtype=args.dtype, device=args.device,
                        seed=args.seed, model_dirs=args.model_dirs)
    prompts = make_prompts(row, model.config.vocab_size, args.seed)
    engines = engines_for(row, model, args, before)
    # warm-up at the row's full length: one-off costs (allocator, lazy imports, kernel plans per KV length, our CUDA
    # graphs of every span) stay out of the timings, for HF as for ours. Rows of >= 2048 new tokens (HF never runs
    # them on GPU: --hf-max-new) warm up at --long-warmup-new: graphs of longer spans are captured in the timed call
    long = row.new_tokens >= 2048
    for eng in engines:
        eng.run(prompts, min(args.long_warmup_new, row.new_tokens) if long and eng.label != "hf" else row.new_tokens)
    repeats = args.long_repeats if row.new_tokens >= 2048 else args.repeats
    if any(e.label == "hf" for e in engines):
        repeats = max(3, repeats) | 1  # the HF baseline: a median of an odd number >= 3
    results: list[list[Result]] = [[] for _ in engines]
    for _ in range(repeats):  # interleaved: every engine sees the same share of the machine's load
        for i, eng in enumerate(engines):
            results[i].append(eng.run(prompts, row.new_tokens))
    med = [median_result(r) for r in results]
    w_bytes, kv_token = weight_bytes(model), kv_bytes_per_token(model)
    lines = []
    hf = next((m for e, m in zip(engines, med) if e.label == "hf"), None)  # every row is compared to dense hf
    for eng, res in zip(engines, med):
        before_res = next((m for e, m in zip(engines, med) if e.label == "before" and e.kv == eng.kv), None) \
            if eng.label == "after" else None
        roofline_s = (res.forwards * w_bytes + res.kv_read_tokens * kv_token) / bandwidth
        lines.append(format_row(row, eng, res, hf, before_res, roofline_s))
        print(lines[-1], flush=True)
    del model, engines
    return lines


def _batch_record(line: str) -> dict:
    """A per-batch table row as a JSON record (its header's columns)."""
    names = [c.strip() for c in HEADER.splitlines()[0].strip().strip("|").split("|")]
    return {"table": "batch", **dict(zip(names, (c.strip() for c in line.strip().strip("|").split("|"))))}


def _write_json(path: str | None, records: list[dict], stamp: str) -> None:
    if path:
        with open(path, "a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps({**record, "machine": stamp}) + "\n")


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    runs.CLOCK = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    before = load_before(args.before) if args.before else None
    try:
        bandwidth = measure_bandwidth(args.device)
        load = os.getloadavg()
        import transformers

        stamp = machine(args.device, args.threads)
        print(f"# {stamp}; {args.device} {args.dtype}, transformers {transformers.__version__}; copy bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s (read + write); load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
              f"before = {args.before or '-'}; medians of {args.repeats} interleaved runs ({args.long_repeats} for >= "
              f"2048 new tokens); buffer {args.buffer}, window {args.window}; {args.clock} clock")
        lines, records = [], []
        if args.same_memory_gib:  # first, so that a time limit on the rows below cannot lose it
            print(f"Same total memory: sequences that fit\n# {stamp}\n" + FIT_HEADER)
            for row in args.same_memory_rows:
                for record in fit_rows(row, args):
                    lines.append(format_fit(record))
                    records.append(record)
                    print(lines[-1], flush=True)
            _write_json(args.json, records, stamp)
            if not args.same_memory_fit_only:
                print(f"\nSame total memory: throughput\n# {stamp}\n" + RUN_HEADER)
                for row in args.same_memory_rows:
                    measured = measured_rows(row, args)
                    lines += [format_run(r) for r in measured]
                    _write_json(args.json, measured, stamp)
            print()
        if args.count_ops:
            print(f"Operations dispatched\n# {stamp}\n" + OPS_HEADER)
            for row in args.rows:
                lines += op_count_rows(row, args, before)
            print()
        if not args.same_memory_only:
            print(f"# {stamp}\n" + HEADER)
            for row in args.rows:
                row_lines = run_row(row, args, before, bandwidth)
                lines += row_lines
                _write_json(args.json, [_batch_record(line) for line in row_lines], stamp)
        print(f"# load average at the end {os.getloadavg()[0]:.1f}")
        return lines
    finally:
        if before is not None:
            shutil.rmtree(before.__bench_tmp__, ignore_errors=True)


if __name__ == "__main__":
    main()
