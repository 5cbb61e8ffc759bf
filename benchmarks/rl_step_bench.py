"""The whole GRPO step, dense vs Sparse-RL at the same rollout memory: N steps of the training loop itself.

Each step is `train.run_rollout` + `train.train_rollout` over the project's own components
(`components.build_components`: the embedded
engine and the learner colocated on one device, the engine giving back its KV cache while the learner works),
on a config-built model of a real shape (random weights: timings do not depend on them) and a synthetic task whose
answers run to --response-len tokens (EOS ignored, no stop token) with a reward that costs nothing
(`tasks/fixed_length.py`). Two modes, one after the other in this process:
- dense:  GRPO on dense rollouts (--kv-method none, no correction);
- sparse: Sparse-RL, R-KV rollouts (--kv-budget + --kv-buffer slots per sequence) with the `mis` correction.
Both get the same rollout memory, --kv-gib, passed as the trainer's own `--rollout-kv-cache-gib` and nothing else: the
engine admits the rows that fit (its own admission, capacity rounding included), so the dense engine decodes fewer
sequences at once. The engine gives its cache back while the learner works and takes it again (--offload-rollout, on
in one process) and keeps its runner and CUDA graphs across steps: the "runner builds" and "captures" columns count
what each step built and captured (0 after the first step, which warms up). Each phase is timed around the component
call that does it (a device sync on each side): rollout (engine.generate, with the KV cache taken and given back),
reward (decode + reward function), recompute (learner.compute_logprobs: pi_old), learner step (learner.train_step),
weight update (engine.sync_from), correction (the sparsity correction, advantages and their metrics: the pipeline's
functions); "other" is the rest of the loop's step (bookkeeping), and the phases plus other are the step. Per phase:
seconds, and on CUDA the peak device memory (torch's allocated + the KV cache mapped at fixed addresses) beside the
planner's estimate (planner/step_memory.py). The table's medians are over the steps after the first (all with --steps 1).

    python benchmarks/rl_step_bench.py                  # Qwen2.5-1.5B shape, 64 x 8 x (128 + 4096), 24 GiB (#43's size)
    python benchmarks/rl_step_bench.py --shape 7b --prompts 16          # other shapes: tiny 0.5b 1.5b 3b 7b
    python benchmarks/rl_step_bench.py --shape tiny --device cpu --steps 2   # the CI-sized run (tests)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/rl_step_bench.py` from a checkout
    sys.path.insert(0, str(REPO))

from slime_sparse.components import build_components  # noqa: E402
from slime_sparse.config import TrainConfig  # noqa: E402
from slime_sparse.config_loader import load_config  # noqa: E402
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.planner.known_models import known_config  # noqa: E402
from slime_sparse.planner.step_memory import StepSpec, phase_peaks, plan_step  # noqa: E402
from slime_sparse.utils.model_shape import ModelShape  # noqa: E402
from slime_sparse.tasks.fixed_length import write_prompts  # noqa: E402
from slime_sparse.tasks.tokenizer import build_char_tokenizer, save_tokenizer  # noqa: E402
from slime_sparse.run import run_rollout, train_rollout  # noqa: E402
from slime_sparse.utils.seed import set_seed  # noqa: E402

from benchmarks.phase_clock import CLOCKS, PhaseClock, timed_components  # noqa: E402
from benchmarks.rollout_runs import machine  # noqa: E402

TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True,
        "max_position_embeddings": 1024}
SHAPES = {"tiny": TINY, **{s: known_config(f"Qwen2.5-{s.upper()}") for s in ("0.5b", "1.5b", "3b", "7b")}}
# per shape: prompts, samples per prompt, prompt length, response length, KV budget, buffer, window
SIZES = {"tiny": (2, 4, 16, 64, 16, 8, 4)}
DEFAULT_SIZES = (64, 8, 128, 4096, 512, 128, 8)
# rollout memory of both modes (--kv-gib): #43's 24 GiB; tiny: what its 8 sparse rows take in fp32 on CPU with every
# working set (kv/engine_memory.py), where the dense rows of 80 slots fit 2
KV_GIB = {"tiny": 620_000 / 2**30}
DEFAULT_KV_GIB = 24.0
PHASES = ("rollout", "reward", "recompute", "learner step", "weight update", "correction")
PLANNED = {"rollout": "rollout", "recompute": "recompute", "learner step": "train", "weight update": "weight update"}
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0}  # dense bf16, SXM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.5b", help="Qwen2.5's shapes, or tiny (tests)")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per mode, the first a warm-up")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (--rollout-batch-size)")
    p.add_argument("--n-samples", type=int, default=None, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--response-len", type=int, default=None, help="tokens every answer runs to")
    p.add_argument("--kv-budget", type=int, default=None)
    p.add_argument("--kv-buffer", type=int, default=None)
    p.add_argument("--kv-window", type=int, default=None)
    p.add_argument("--kv-gib", type=float, default=None,
                   help=f"rollout memory of both modes, KV and working sets (--rollout-kv-cache-gib; default "
                        f"{DEFAULT_KV_GIB:g}, tiny: {KV_GIB['tiny'] * 2**30:,.0f} bytes)")
    p.add_argument("--modes", nargs="+", choices=["dense", "sparse"], default=["dense", "sparse"])
    p.add_argument("--train-backend", choices=["embedded", "megatron"], default="embedded")
    p.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help=f"learner micro-batches (default {TrainConfig.max_tokens_per_gpu}; tiny: 256)")
    p.add_argument("--recompute-granularity", choices=["none", "full"], default="full")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu = this process's CPU time: steadier on a shared CPU machine (with --threads 1)")
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "rl_step_bench"), help="where the model is written")
    p.add_argument("--out", default=None, help="also write one JSON line per step here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = SIZES.get(args.shape, DEFAULT_SIZES)
    for name, default in zip(("prompts", "n_samples", "prompt_len", "response_len", "kv_budget", "kv_buffer",
                              "kv_window"), sizes):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.kv_gib is None:
        args.kv_gib = KV_GIB.get(args.shape, DEFAULT_KV_GIB)
    if not args.kv_gib > 0:
        p.error("--kv-gib must be > 0")
    if args.max_tokens_per_gpu is None:
        args.max_tokens_per_gpu = 256 if args.shape == "tiny" else TrainConfig.max_tokens_per_gpu
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    for name in ("steps", "prompts", "n_samples", "response_len", "kv_budget", "kv_buffer", "kv_window",
                 "max_tokens_per_gpu", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.n_samples < 2 or args.prompt_len < 2:
        p.error("--n-samples and --prompt-len must be >= 2 (GRPO groups; <s> plus one character)")
    if args.kv_budget + args.kv_buffer >= args.prompt_len + args.response_len:
        p.error("--kv-budget + --kv-buffer must be below --prompt-len + --response-len, or nothing is compressed")
    return args


# ---------------------------------------------------------------------------------------------------------------
# The model directory, the modes' configs
# ---------------------------------------------------------------------------------------------------------------
def model_dir(args) -> Path:
    """An HF directory of the shape (random weights, seeded) and the character tokenizer, written once per shape,
    dtype and context."""
    from transformers import AutoConfig, AutoModelForCausalLM

    context = max(SHAPES[args.shape]["max_position_embeddings"], args.prompt_len + args.response_len + 1)
    path = Path(args.cache_dir) / f"{args.shape}-{args.dtype}-{context}"
    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        return path
    fields = {**SHAPES[args.shape], "max_position_embeddings": context}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(args.seed)
    with torch.device(args.device):  # random init on the device: seconds for a 7B on a GPU, not minutes on a CPU
        model = AutoModelForCausalLM.from_config(config)
    tmp = path.parent / f"{path.name}.tmp"
    model.to(torch.bfloat16 if args.dtype == "bf16" else torch.float32).save_pretrained(tmp)
    save_tokenizer(build_char_tokenizer(), tmp)
    del model
    _free(args.device)
    tmp.rename(path)
    return path


def kv_config(args, mode: str) -> KVCompressConfig:
    if mode == "dense":
        return KVCompressConfig()
    return KVCompressConfig(method="rkv", budget=args.kv_budget, buffer=args.kv_buffer, window=args.kv_window)


def trainer_flags(args, mode: str, model: Path, prompts: Path, run_dir: Path) -> list[str]:
    kv = kv_config(args, mode)
    flags = ["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--run-dir", str(run_dir),
             "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.n_samples),
             "--global-batch-size", str(args.prompts * args.n_samples), "--num-rollout", str(args.steps),
             "--rollout-max-response-len", str(args.response_len), "--rollout-ignore-eos", "--rollout-temperature",
             "1.0", "--rollout-kv-cache-gib", repr(args.kv_gib),
             "--custom-rm-path", "slime_sparse.tasks.fixed_length:reward",
             "--rm-num-workers", "0", "--device", args.device, "--train-backend", args.train_backend,
             "--max-tokens-per-gpu", str(args.max_tokens_per_gpu), "--lr", "1e-6", "--seed", str(args.seed),
             "--mismatch-metrics-interval", "0", "--no-progress-bar", "--no-use-tensorboard",
             "--kv-method", kv.method, "--correction-preset", "mis" if kv.enabled else "none"]
    if kv.enabled:
        flags += ["--kv-budget", str(kv.budget), "--kv-buffer", str(kv.buffer), "--kv-window", str(kv.window)]
    if args.dtype == "bf16":
        flags.append("--bf16")
    if args.recompute_granularity != "none":
        flags += ["--recompute-granularity", args.recompute_granularity]
    return flags


# ---------------------------------------------------------------------------------------------------------------
# Running a mode
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepResult:
    mode: str
    step: int
    seconds: dict[str, float]  # per phase, "other" and "step"
    peak: dict[str, int]  # per phase (CUDA only)
    gen_tokens: int
    learner_tokens: int
    rows: int
    runner_builds: int  # rollout runners the step built (each allocates a cache and, on CUDA, captures its graphs)
    captures: int  # CUDA graphs captured during the step's rollout


def run_mode(args, mode: str, model: Path, shape: ModelShape, work: Path) -> tuple[list[StepResult], dict]:
    prompts = write_prompts(work / "prompts.jsonl", args.prompts * args.steps, args.prompt_len, seed=args.seed)
    cfg = load_config(trainer_flags(args, mode, model, prompts, work / mode))
    # answers run to --response-len: no stop token at all (the loaded config stops at the tokenizer's EOS)
    cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, stop_token_ids=()))
    set_seed(cfg.train.seed)
    components = build_components(cfg)
    engine, seqs = components.engine, args.prompts * args.n_samples
    rows = min(engine.rows_for(cfg.kv, args.prompt_len + args.response_len), seqs)  # the engine's own admission
    clock = PhaseClock(args.device, CLOCKS[args.clock])
    captures = CaptureCount(engine)
    results = []
    try:
        with captures, timed_components(components, clock):  # the clock times the counted call
            for step in range(args.steps):
                clock.reset()
                builds, captures.total = engine.runner_builds, 0
                clock.sync()
                t0 = clock.clock()
                metrics = train_rollout(cfg, components, *run_rollout(cfg, components, step))
                clock.sync()
                total = clock.clock() - t0
                seconds = {phase: clock.seconds.get(phase, 0.0) for phase in PHASES}
                seconds["other"] = total - sum(seconds.values())
                seconds["step"] = total
                learner_tokens = args.prompts * args.n_samples * args.prompt_len + int(metrics["rollout/gen_tokens"])
                results.append(StepResult(mode, step, seconds, dict(clock.peak), int(metrics["rollout/gen_tokens"]),
                                          learner_tokens, rows, engine.runner_builds - builds, captures.total))
                print(f"# {mode} step {step + 1}/{args.steps}: {total:.2f} s (" + ", ".join(
                    f"{p} {seconds[p]:.2f}" for p in (*PHASES, "other")) + f"); rows {rows}, runner builds "
                    f"{results[-1].runner_builds}, captures {results[-1].captures}", flush=True)
        slots = engine.last_stats.slots  # the cache rows' slots, the engine's rounding included
    finally:
        components.close()
    step_spec = StepSpec(seqs=seqs, prompt_len=args.prompt_len,
                         response_len=args.response_len, engine_rows=rows, kv_slots=slots,
                         kv_window=args.kv_window if mode == "sparse" else 0,
                         max_tokens_per_gpu=args.max_tokens_per_gpu,
                         recompute=None if args.recompute_granularity == "none" else args.recompute_granularity,
                         dtype_bytes=_dtype_bytes(args), learner=args.train_backend,
                         offload_rollout=cfg.offloads_rollout, with_ref=cfg.loss.needs_ref)
    del components
    _free(args.device)
    return results, phase_peaks(plan_step(shape, step_spec))


class CaptureCount:
    """CUDA graphs the engine captures over its generate() calls (a rollout may take several: dynamic sampling)."""

    def __init__(self, engine) -> None:
        self.engine, self.total = engine, 0

    def __enter__(self):
        generate = self.engine.generate

        def counted(*a, **k):
            out = generate(*a, **k)
            self.total += self.engine.last_stats.captures
            return out
        self.engine.generate = counted  # an instance attribute over the class's method, removed on exit
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.generate


def _dtype_bytes(args) -> int:
    return 2 if args.dtype == "bf16" else 4


def _free(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------
TIME_HEADER = ("| mode | rows at once | step s | rollout s | reward s | recompute s | learner step s | weight update s "
               "| correction s | other s | gen tok/s | learner tok/s | learner MFU % | runner builds | captures |\n"
               + "|---" * 15 + "|")
MEMORY_HEADER = "| mode | phase | measured peak MiB | planner MiB | planner / measured |\n" + "|---" * 5 + "|"
RATIO_HEADER = "| | dense s | sparse s | dense / sparse |\n" + "|---" * 4 + "|"


def timed_steps(results: list[StepResult]) -> list[StepResult]:
    return results[1:] or results  # the first step warms up


def median_seconds(results: list[StepResult], key: str) -> float:
    return statistics.median(r.seconds[key] for r in timed_steps(results))


def learner_flops(shape: ModelShape, args, tokens: int) -> float:
    """Matmul FLOPs of one step's recompute + training: 2 per weight per token and pass (forward once for
    pi_old, three times for forward + backward, once more under full recompute), the LM head on response tokens
    only, and causal attention (2 x 2 x heads x head_dim x mean context per token and layer)."""
    h, layers = shape.hidden_size, shape.num_layers
    head = shape.vocab_size * h
    per_layer = shape.num_parameters() - head * (1 if shape.tie_word_embeddings else 2)
    seqs = args.prompts * args.n_samples
    response = tokens - seqs * args.prompt_len
    attention = 4 * shape.num_heads * shape.head_dim * layers * (args.prompt_len + args.response_len) / 2
    forward = 2 * per_layer * tokens + attention * tokens + 2 * head * response
    passes = 1 + 3 + (1 if args.recompute_granularity == "full" else 0)
    return passes * forward


def time_row(mode: str, results: list[StepResult], shape: ModelShape, args) -> str:
    med = {key: median_seconds(results, key) for key in (*PHASES, "other", "step")}
    last = timed_steps(results)[-1]
    learner_s = med["recompute"] + med["learner step"]
    peak = _peak_flops()
    mfu = f"{100 * learner_flops(shape, args, last.learner_tokens) / learner_s / peak:.1f}" if peak else "-"
    timed = timed_steps(results)
    return (f"| {mode} | {last.rows} | {med['step']:.3f} | " + " | ".join(f"{med[p]:.3f}" for p in (*PHASES, "other"))
            + f" | {last.gen_tokens / med['rollout']:.0f} | {last.learner_tokens / learner_s:.0f} | {mfu} | "
            + f"{sum(r.runner_builds for r in timed)} | {sum(r.captures for r in timed)} |")


def memory_rows(mode: str, results: list[StepResult], planned: dict[str, int]) -> list[str]:
    """Per planned phase: the peak allocated (CUDA; "-" elsewhere) over the timed steps, and the planner's."""
    rows = []
    for phase, planned_phase in PLANNED.items():
        measured = max((r.peak.get(phase, 0) for r in timed_steps(results)), default=0)
        plan = planned[planned_phase]
        cells = [f"{measured / 2**20:.1f}" if measured else "-", f"{plan / 2**20:.1f}",
                 f"{plan / measured:.2f}" if measured else "-"]
        rows.append(f"| {mode} | {phase} | " + " | ".join(cells) + " |")
    return rows


def _peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS.items() if key in name), None)


def main(argv: list[str] | None = None) -> dict[str, list[str]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = ModelShape.from_hf_config(SHAPES[args.shape])
    device = f"{machine(args.device, args.threads)}, {args.clock} clock"  # the stamp of every table below
    print(f"# {args.shape} shape ({shape.num_parameters() / 1e9:.2f}B), {args.dtype}, {device}; "
          f"{args.prompts} prompts x {args.n_samples} samples x ({args.prompt_len} + {args.response_len}) tokens; "
          f"{args.train_backend} learner, micro-batches of {args.max_tokens_per_gpu} tokens, recompute "
          f"{args.recompute_granularity}; sparse = R-KV {args.kv_budget} + {args.kv_buffer}; {args.steps} steps per "
          f"mode, the first a warm-up", flush=True)
    model = model_dir(args)
    runs: dict[str, tuple[list[StepResult], dict]] = {}
    with tempfile.TemporaryDirectory(prefix="rl_step_bench_") as tmp:
        for mode in args.modes:
            runs[mode] = run_mode(args, mode, model, shape, Path(tmp))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            for results, _ in runs.values():
                for r in results:
                    f.write(json.dumps({**dataclasses.asdict(r), "shape": args.shape, "dtype": args.dtype,
                                        "device": device, "prompts": args.prompts, "n_samples": args.n_samples,
                                        "prompt_len": args.prompt_len, "response_len": args.response_len,
                                        "kv_gib": args.kv_gib, "torch": torch.__version__}) + "\n")
    tables = {"time": [time_row(mode, results, shape, args) for mode, (results, _) in runs.items()],
              "memory": [row for mode, (results, plan) in runs.items() for row in memory_rows(mode, results, plan)]}
    print(f"\n# {device}\n" + TIME_HEADER + "\n" + "\n".join(tables["time"]))
    print(f"\n# {device}\n" + MEMORY_HEADER + "\n" + "\n".join(tables["memory"]))
    if {"dense", "sparse"} <= set(runs):
        ratio = []
        for key, label in (("step", "whole step"), ("rollout", "rollout phase")):
            dense, sparse = (median_seconds(runs[m][0], key) for m in ("dense", "sparse"))
            ratio.append(f"| {label} | {dense:.3f} | {sparse:.3f} | {dense / sparse:.2f} |")
        tables["ratio"] = ratio
        print(f"\n# {device}\n" + RATIO_HEADER + "\n" + "\n".join(ratio))
    return tables


if __name__ == "__main__":
    main()
