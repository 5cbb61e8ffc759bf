"""What the rollout benchmark runs: model shapes, rows, prompts, and the engines it times (HF generate(), this
checkout's EmbeddedEngine, the EmbeddedEngine of an older commit), with their compression timed. The tables are
`rollout_bench.py` (tokens/s per batch) and `rollout_tables.py` (the same KV memory, operation counts).
"""
from __future__ import annotations

import dataclasses
import importlib
import io
import os
import platform
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
if str(REPO) not in sys.path:  # `python benchmarks/<script>.py` from a checkout
    sys.path.insert(0, str(REPO))

from slime_sparse.kv import KVCompressConfig  # noqa: E402
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


def machine(device: str, threads: int | None = None) -> str:
    """What made a table: the GPU (or the CPU model and threads), torch and CUDA versions."""
    if torch.device(device).type == "cuda":
        where = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                      if line.startswith("model name")), platform.processor() or "unknown CPU")
        where = f"{model}, {threads or torch.get_num_threads()} thread(s) of {os.cpu_count()}"
    return f"{where}, torch {torch.__version__}"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


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

    def run(prompts: list[list[int]], n_new) -> Result:
        """n_new: every response runs to exactly this many tokens; or the SamplingParams of the call."""
        fixed = isinstance(n_new, int)
        params = params_cls(temperature=1.0, max_new_tokens=n_new, ignore_eos=True) if fixed else n_new
        COMPRESS_TIMER["s"] = 0.0
        sync(args.device)
        t0 = CLOCK()
        outs = engine.generate(prompts, params, seed=args.seed)
        sync(args.device)
        seconds = CLOCK() - t0
        assert not fixed or all(len(o.response_ids) == n_new for o in outs)
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


def median_result(results: list[Result]) -> Result:
    """Medians of the times; captures: the most any of the calls captured (0: every one replayed warm graphs)."""
    mid = sorted(results, key=lambda r: r.seconds)[len(results) // 2]
    return dataclasses.replace(mid, seconds=statistics.median(r.seconds for r in results),
                               compress_s=statistics.median(r.compress_s for r in results),
                               captures=max(r.captures for r in results))


def model_config(name: str, args):
    """The HF config of a preset or of a --model directory (no weights)."""
    from transformers import AutoConfig, LlamaConfig, Qwen2Config

    if name in args.model_dirs:
        return AutoConfig.from_pretrained(args.model_dirs[name])
    arch, shape = PRESETS[name]
    return (Qwen2Config if arch == "qwen2" else LlamaConfig)(**shape)
