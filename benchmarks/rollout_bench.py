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
tokens saved by sharing a prompt's prefill across its n samples, and whether `after` drew the same tokens as
`before` (same seed).

    python benchmarks/rollout_bench.py --quick --before 8401d90        # ~3 min on an idle 2-core machine
    python benchmarks/rollout_bench.py --before 8401d90                # the table of benchmarks/README.md
    python benchmarks/rollout_bench.py --rows smollm2-135m:8:128:256 --model smollm2-135m=/path/to/hf_dir
    python benchmarks/rollout_bench.py --device cuda --dtype bfloat16 --rows qwen2-19m:64:128:1024 qwen2-19m:64:128:4096

A row is MODEL:BATCH:PROMPT:NEW[:N]: BATCH sequences = BATCH / N distinct prompts x N samples (GRPO groups).
MODEL is a preset (config-built, random weights: timings do not depend on weight values) or NAME=DIR for a local
HF directory (e.g. SmolLM2-135M-Instruct built by #14's `tools/gguf_to_hf.py`), then used as NAME in rows.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/rollout_bench.py` from a checkout
    sys.path.insert(0, str(REPO))

from slime_sparse.kv import METHODS, KVCompressConfig  # noqa: E402
from slime_sparse.rollout import SamplingParams  # noqa: E402
from slime_sparse.rollout.embedded import EmbeddedEngine  # noqa: E402

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
# Config-built models (random weights). smollm2-135m is SmolLM2-135M's architecture (a Llama).
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny": ("qwen2", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)),
    "qwen2-19m": ("qwen2", dict(vocab_size=16384, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                                num_attention_heads=6, num_key_value_heads=2)),
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0)),
    # Qwen2.5-1.5B(-Instruct)'s config.json: the issue's GPU rows (#28)
    "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, rope_theta=1000000.0)),
}
# Each suite fits the time budget written next to it on an idle 2-core machine (1 thread, fp32).
SUITES: dict[str, list[str]] = {
    "ci": ["tiny:4:24:40", "tiny:4:24:40:2"],
    # one H100 / H200, bf16 (tools/gpu_checks.sh: --hf-max-new 128 --same-kv-gib 8 --same-kv-max-prompts 256, its
    # same-KV row GPU_SAME_KV first): batch 64 at 128 new tokens (warm HF, dense, R-KV at a tight 64 + 32). Measured on
    # an H200 2026-11-27: the same-KV rows and this one take ~170 s together. gpu-extra: batch 256 at 4096 (dense vs
    # R-KV 512 + 128: over 2 minutes on its own) and the rest
    "gpu": ["qwen2.5-1.5b:64:128:128@64+32"],
    "gpu-extra": ["qwen2.5-1.5b:256:128:4096", "qwen2.5-1.5b:64:128:4096", "qwen2.5-1.5b:64:128:1024",
                  "qwen2.5-1.5b:256:128:1024"],
    "quick": ["qwen2-19m:8:64:256", "qwen2-19m:8:64:1024", "qwen2-19m:32:512:256:8"],
    "full": ["qwen2-19m:8:64:256", "qwen2-19m:8:64:1024", "qwen2-19m:8:64:4096", "qwen2-19m:32:64:256",
             "qwen2-19m:64:64:256", "qwen2-19m:32:512:256:8", "smollm2-135m:8:128:256"],
}
GPU_SAME_KV = ["qwen2.5-1.5b:1:128:4096"]  # the same-KV-memory row of #33 (the batch is what fits)
SUITE_KV = {"ci": ([16], 8), "quick": ([512], 128), "full": ([512], 128), "gpu": ([512], 128),
            "gpu-extra": ([512], 128)}  # (budgets, buffer)


@dataclass(frozen=True)
class RowSpec:
    model: str
    batch: int
    prompt_len: int
    new_tokens: int
    n_samples: int = 1
    kv: tuple[int, int] | None = None  # (budget, buffer) of this row's compressions instead of --budgets / --buffer

    @classmethod
    def parse(cls, text: str) -> "RowSpec":
        shape, _, kv = text.partition("@")
        try:
            model, *nums = shape.split(":")
            budget_buffer = tuple(int(x) for x in kv.split("+")) if kv else None
            if budget_buffer is not None and len(budget_buffer) != 2:
                raise ValueError
            spec = cls(model, *(int(x) for x in nums), kv=budget_buffer)
        except (TypeError, ValueError):
            raise SystemExit(f"--rows {text!r}: expected MODEL:BATCH:PROMPT:NEW[:N][@BUDGET+BUFFER] with integers"
                             ) from None
        if min(spec.batch, spec.prompt_len, spec.new_tokens, spec.n_samples) < 1 or spec.batch % spec.n_samples:
            raise SystemExit(f"--rows {text!r}: sizes must be >= 1 and N must divide BATCH")
        return spec


@dataclass
class Result:
    """One engine call."""

    seconds: float
    kv_bytes: int
    kv_read_tokens: int  # KV slots read over all forwards (sum over samples of the slots each token's forward saw)
    forwards: int
    compress_s: float = 0.0
    prefill_saved: int = 0
    tokens: list[list[int]] = field(default_factory=list)
    rows: int = 0  # sequences decoded at once (the engine's cache rows)
    captures: int = 0  # CUDA graphs captured during the call (0 once warm)


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
    p.add_argument("--same-kv-gib", type=float, default=None,
                   help="also print how many sequences of each row fit in this much KV memory, dense vs each "
                        "compression, by the engine's own allocation (one slot row per sequence), and the tok/s of "
                        "each at that memory (the engine admitting as many rows as fit): the headline table")
    p.add_argument("--same-kv-max-prompts", type=int, default=512,
                   help="at most this many prompts in a same-KV-memory run (each config decodes one wave of its fit)")
    p.add_argument("--same-kv-warmup-new", type=int, default=None,
                   help="new tokens of the warm-up call of a same-KV-memory run (default: the row's)")
    p.add_argument("--same-kv-rows", nargs="+", default=None, metavar="ROW",
                   help="rows of the same-KV-memory tables (MODEL:BATCH:PROMPT:NEW[@B+BUFFER]; BATCH unused: what fits "
                        "decodes); default: the suite's rows (--suite gpu: GPU_SAME_KV)")
    p.add_argument("--same-kv-only", action="store_true", help="only the same-KV-memory tables (no per-batch rows)")
    p.add_argument("--same-kv-fit-only", action="store_true",
                   help="of the same-KV-memory tables, only the arithmetic one (what fits; no model is run)")
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
    args.same_kv_rows = [RowSpec.parse(r) for r in args.same_kv_rows] if args.same_kv_rows else (
        [RowSpec.parse(r) for r in GPU_SAME_KV] if suite == "gpu" and not args.rows_given else args.rows)
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
    for name in ("repeats", "long_repeats", "buffer", "window", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------------------------
# Models, prompts, machine
# ---------------------------------------------------------------------------------------------------------------
def build_model(name: str, context: int, *, dtype: str = "fp32", device: str = "cpu", seed: int = 0,
                model_dirs: dict[str, str] | None = None) -> torch.nn.Module:
    """A preset built from its config (random weights, seeded) or a local HF directory of `model_dirs`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if model_dirs and name in model_dirs:
        model = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=DTYPES[dtype])
    else:
        arch, shape = PRESETS[name]
        config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
        torch.manual_seed(seed)
        model = model_cls(config_cls(**shape, max_position_embeddings=context, tie_word_embeddings=True))
    if model.config.max_position_embeddings < context:
        raise SystemExit(f"{name}: context {model.config.max_position_embeddings} < prompt + new tokens = {context}")
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct weight tensors (a tied LM head counted once): what each forward reads."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure_bandwidth(device: str, mib: int = 256) -> float:
    """Bytes/s of a large tensor copy, counting read + write (best of 5): the memory bandwidth a decode step
    streaming weights and KV can hope for."""
    src = torch.ones(mib << 18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = CLOCK()
        dst.copy_(src)
        sync(device)
        best = min(best, CLOCK() - t0)
    return 2 * src.nbytes / best


def make_prompts(row: RowSpec, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    distinct = torch.randint(0, vocab, (row.batch // row.n_samples, row.prompt_len), generator=g).tolist()
    return [p for p in distinct for _ in range(row.n_samples)]  # GRPO layout: n consecutive samples per prompt


# ---------------------------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------------------------
def load_before(rev: str) -> ModuleType:
    """The `slime_sparse` package of commit `rev`, importable as `slime_sparse_before` (every occurrence of the
    name is rewritten, so its modules import each other and register their own attention function)."""
    tmp = Path(tempfile.mkdtemp(prefix="rollout_bench_"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "slime_sparse"],
                             capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"--before {rev}: git archive failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    pkg = tmp / "slime_sparse_before"
    (tmp / "slime_sparse").rename(pkg)
    for path in pkg.rglob("*.py"):
        path.write_text(path.read_text().replace("slime_sparse", "slime_sparse_before"))
    sys.path.insert(0, str(tmp))
    module = importlib.import_module("slime_sparse_before")
    module.__bench_tmp__ = tmp
    return module


@dataclass
class Engine:
    """One column of a row: a label, its KV config, and how to run it."""

    label: str  # hf | before | after
    kv: KVCompressConfig
    run: Callable[[list[list[int]], int], Result]

    @property
    def kv_name(self) -> str:
        return "dense" if not self.kv.enabled else f"{self.kv.method} B={self.kv.budget}"


def hf_engine(model, device: str) -> Callable[[list[list[int]], int], Result]:
    def run(prompts: list[list[int]], n_new: int) -> Result:
        ids = torch.tensor(prompts, device=device)
        sync(device)
        t0 = CLOCK()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0,
                                 return_dict_in_generate=True)
        sync(device)
        seconds = CLOCK() - t0
        p = ids.shape[1]
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.past_key_values.layers)
        read = len(prompts) * sum(p + t for t in range(n_new))
        return Result(seconds, kv, read, n_new, tokens=out.sequences[:, p:].tolist())
    return run


def our_engine(engine_cls, params_cls, model, kv, args, batch: int | None, **options
               ) -> Callable[[list[list[int]], int], Result]:
    """An EmbeddedEngine (this checkout's or --before's) with its compression timed by wrapping what compresses
    (`COMPRESS_TARGETS`, with a device sync, so the time is the compression's own on GPU too). `options`: engine keyword
    arguments (step_mode, kv_cache_gib); batch None: as many rows as kv_cache_gib holds."""
    engine = engine_cls(model, kv, max_batch_size=batch, device=args.device, **options)
    for cls, name in compress_targets(engine_cls):
        if not hasattr(vars(cls)[name], "__wrapped__"):
            setattr(cls, name, _timed(vars(cls)[name], args.device))

    def run(prompts: list[list[int]], n_new: int) -> Result:
        params = params_cls(temperature=1.0, max_new_tokens=n_new, ignore_eos=True)
        COMPRESS_TIMER["s"] = 0.0
        sync(args.device)
        t0 = CLOCK()
        outs = engine.generate(prompts, params, seed=args.seed)
        sync(args.device)
        seconds = CLOCK() - t0
        assert all(len(o.response_ids) == n_new for o in outs)
        stats = getattr(engine, "last_stats", None)
        return Result(seconds, engine.last_kv_cache_bytes, sum(o.kv.kept_kv_tokens for o in outs),
                      stats.forwards if stats else n_new, COMPRESS_TIMER["s"],
                      stats.prefill_tokens_saved if stats else 0, [o.response_ids for o in outs],
                      getattr(stats, "rows", batch or 0), getattr(stats, "captures", 0))
    run.engine = engine
    return run


# What compresses, in the engines of any commit we compare: (module of the engine's package, class, method).
COMPRESS_TARGETS = (("compressor", "Compressor", "__call__"), ("engine", "_Run", "_compress_rows"))
STEP_TARGETS = (("step", "DecodeStep", "run"),)
COMPRESS_TIMER = {"s": 0.0}  # engines run one at a time: one timer, reset by each call
CLOCK = time.perf_counter  # main() sets --clock


def compress_targets(engine_cls, targets=COMPRESS_TARGETS) -> list[tuple[type, str]]:
    """The (class, method name) pairs of `targets` that exist in the package of `engine_cls`."""
    package = engine_cls.__module__.rsplit(".", 1)[0]
    found = []
    for module_name, cls_name, method in targets:
        try:
            module = importlib.import_module(f"{package}.{module_name}")
        except ImportError:
            continue
        cls = getattr(module, cls_name, None)
        if cls is not None and method in vars(cls):
            found.append((cls, method))
    return found


def _timed(fn, device: str):
    timer = COMPRESS_TIMER

    def wrapper(*a, **k):
        sync(device)
        t0 = CLOCK()
        out = fn(*a, **k)
        sync(device)
        timer["s"] += CLOCK() - t0
        return out
    wrapper.__wrapped__ = fn
    return wrapper


def compressions(row: RowSpec, args) -> list[KVCompressConfig]:
    """The row's compressed configs: each --methods at each --budgets with --buffer, or at the row's own @B+BUFFER."""
    pairs = [row.kv] if row.kv else [(budget, args.buffer) for budget in args.budgets]
    return [KVCompressConfig(method=method, budget=budget, buffer=buffer, window=args.window)
            for method in args.methods for budget, buffer in pairs]


def engines_for(row: RowSpec, model, args, before: ModuleType | None) -> list[Engine]:
    dense_kv = kv_bytes_per_token(model) * row.batch * (row.prompt_len + row.new_tokens)
    dense_ok = dense_kv <= args.max_kv_gib * 2**30
    if not dense_ok:
        print(f"# {row}: dense engines skipped (dense KV {dense_kv / 2**30:.1f} GiB > --max-kv-gib)")
    kvs = [KVCompressConfig()] if dense_ok else []
    for kv in compressions(row, args):
        if kv.budget + kv.buffer < row.prompt_len + row.new_tokens:  # else the cache never fills: = dense
            kvs.append(kv)
    run_hf = dense_ok and not args.no_hf and (args.hf_max_new is None or row.new_tokens <= args.hf_max_new)
    out = [Engine("hf", KVCompressConfig(), hf_engine(model, args.device))] if run_hf else []
    for kv in kvs:
        if before is not None:
            from slime_sparse_before.kv import KVCompressConfig as BeforeKV
            from slime_sparse_before.rollout import SamplingParams as BeforeParams
            from slime_sparse_before.rollout.embedded import EmbeddedEngine as BeforeEngine

            # the fields the older config knows (a knob added since keeps its default there)
            before_kv = BeforeKV(**{f.name: getattr(kv, f.name) for f in dataclasses.fields(BeforeKV)
                                    if hasattr(kv, f.name)})
            out.append(Engine("before", kv, our_engine(BeforeEngine, BeforeParams, model, before_kv, args, row.batch)))
        out.append(Engine("after", kv, our_engine(EmbeddedEngine, SamplingParams, model, kv, args, row.batch)))
        for mode in args.step_modes:
            out.append(Engine(f"after+{mode}", kv, our_engine(EmbeddedEngine, SamplingParams, model, kv, args,
                                                              row.batch, step_mode=mode)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------------------------
HEADER = ("| model | batch | prompt | new | engine | KV | tok/s | x hf | x before | peak KV MiB | compress % "
          "| roofline % | prefill saved | = before |\n" + "|---" * 14 + "|")


def median_result(results: list[Result]) -> Result:
    mid = sorted(results, key=lambda r: r.seconds)[len(results) // 2]
    return dataclasses.replace(mid, seconds=statistics.median(r.seconds for r in results),
                               compress_s=statistics.median(r.compress_s for r in results))


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
            f"{100 * roofline_s / res.seconds:.1f} | {saved} | {same} |")


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


SAME_KV_HEADER = ("| model | prompt | new | KV memory GiB | KV | slots per sequence | sequences that fit | x dense |\n"
                  + "|---" * 8 + "|")


def same_kv_rows(row: RowSpec, args) -> list[str]:
    """How many sequences of this row fit in --same-kv-gib of KV memory, dense vs each compression, by the engine's
    own allocation (`runner.row_bytes`: keys, values, positions, query ring, attention mass of `kv.row_capacity`
    slots). A compressed sequence holds budget + buffer slots whatever its length, so the ratio grows with the length."""
    from slime_sparse.kv import row_capacity
    from slime_sparse.rollout.embedded.runner import row_bytes

    cfg = model_config(row.model, args)
    longest = row.prompt_len + row.new_tokens
    lines, dense_fit = [], None
    for kv in [KVCompressConfig()] + compressions(row, args):
        slots = row_capacity(kv, longest)
        fit = int(args.same_kv_gib * 2**30 // row_bytes(cfg, kv, slots, DTYPES[args.dtype]))
        dense_fit = fit if dense_fit is None else dense_fit
        name = "dense" if not kv.enabled else f"{kv.method} B={kv.budget}+{kv.buffer}"
        lines.append(f"| {row.model} | {row.prompt_len} | {row.new_tokens} | {args.same_kv_gib:g} | {name} | {slots} | "
                     f"{fit} | {fit / max(dense_fit, 1):.2f} |")
        print(lines[-1], flush=True)
    return lines


def model_config(name: str, args):
    """The HF config of a preset or of a --model directory (no weights)."""
    from transformers import AutoConfig, LlamaConfig, Qwen2Config

    if name in args.model_dirs:
        return AutoConfig.from_pretrained(args.model_dirs[name])
    arch, shape = PRESETS[name]
    return (Qwen2Config if arch == "qwen2" else LlamaConfig)(**shape)


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    before = load_before(args.before) if args.before else None
    try:
        bandwidth = measure_bandwidth(args.device)
        load = os.getloadavg()
        import transformers

        print(f"# device {args.device} {args.dtype}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
              f"transformers {transformers.__version__}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); "
              f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; before = {args.before or '-'}; "
              f"medians of {args.repeats} interleaved runs ({args.long_repeats} for >= 2048 new tokens); "
              f"buffer {args.buffer}, window {args.window}; {args.clock} clock")
        lines = []
        if args.same_kv_gib:  # first, so that a time limit on the rows below cannot lose it
            print("Same KV memory: sequences that fit\n" + SAME_KV_HEADER)
            for row in args.same_kv_rows:
                lines += same_kv_rows(row, args)
            if not args.same_kv_fit_only:
                print("\nSame KV memory: throughput\n" + SAME_KV_RUN_HEADER)
                for row in args.same_kv_rows:
                    lines += same_kv_measured(row, args)
            print()
        if args.count_ops:
            print("Operations dispatched\n" + OPS_HEADER)
            for row in args.rows:
                lines += op_count_rows(row, args, before)
            print()
        if not args.same_kv_only:
            print(HEADER)
            for row in args.rows:
                lines += run_row(row, args, before, bandwidth)
        print(f"# load average at the end {os.getloadavg()[0]:.1f}")
        return lines
    finally:
        if before is not None:
            shutil.rmtree(before.__bench_tmp__, ignore_errors=True)


if __name__ == "__main__":
    main()
