"""Rollout throughput and KV memory of the embedded engine, dense and compressed, against HF generate().

A Qwen2 model is built from a config with random weights (nothing downloaded); every row decodes the same
batch of random prompts for exactly N new tokens (EOS ignored), so all rows do the same amount of work.
Rows: HF generate() (dense, DynamicCache) as the baseline, our engine dense, and our engine with each
method at each budget. Columns: tokens/s and its ratio to the baseline, peak KV bytes (HF: the final dense
cache; ours: the preallocated cache, which is never exceeded) and its ratio, and KV token savings
(1 - kept / dense KV tokens summed over decode steps).

    python benchmarks/rollout_bench.py                       # CPU-sized defaults, a few minutes
    python benchmarks/rollout_bench.py --lengths 256 1024 4096 --device cuda --dtype bf16 --batch-size 64
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.kv import METHODS, KVCompressConfig
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Row:
    length: int
    engine: str
    method: str
    budget: str
    tokens_per_s: float
    kv_bytes: int
    savings: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024], help="new tokens per sequence")
    p.add_argument("--methods", nargs="+", default=["rkv", "snapkv", "streaming", "h2o"],
                   choices=[m for m in METHODS if m != "none"])
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--buffer", type=int, default=128)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu = this process's CPU time: steadier than wall time on a CPU shared with other jobs "
                        "(use with --threads 1; meaningless on GPU)")
    p.add_argument("--repeats", type=int, default=1, help="time each row this many times and keep the fastest")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate() baseline")
    # model shape: the defaults give ~19M parameters
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("batch_size", "prompt_len", "buffer", "window", "layers", "heads", "kv_heads", "hidden", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.lengths) < 1 or min(args.budgets) < 1:
        p.error("--lengths and --budgets must be >= 1")
    return args


def build_model(args: argparse.Namespace) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt_len + max(args.lengths) + 1, tie_word_embeddings=True,
    )
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM(config).to(device=args.device, dtype=DTYPES[args.dtype]).eval()


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def hf_generate(model, prompts: torch.Tensor, n_new: int, device: str, clock: Callable[[], float]) -> tuple[float, int]:
    """(seconds, bytes of the final dense KV cache) of transformers' sampling generate()."""
    ids = prompts.to(device)
    sync(device)
    t0 = clock()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0, return_dict_in_generate=True,
        )
    sync(device)
    seconds = clock() - t0
    assert out.sequences.shape[1] == ids.shape[1] + n_new
    cache = out.past_key_values
    kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return seconds, kv_bytes


def ours(
    engine: EmbeddedEngine, prompts: list[list[int]], n_new: int, device: str, seed: int, clock: Callable[[], float]
) -> tuple[float, int, float]:
    """(seconds, KV bytes allocated, KV token savings) of one engine.generate()."""
    params = SamplingParams(temperature=1.0, max_new_tokens=n_new, ignore_eos=True)
    sync(device)
    t0 = clock()
    outs = engine.generate(prompts, params, seed=seed)
    sync(device)
    seconds = clock() - t0
    assert all(len(o.response_ids) == n_new for o in outs)
    kept = sum(o.kv.kept_kv_tokens for o in outs)
    dense = sum(o.kv.dense_kv_tokens for o in outs)
    return seconds, engine.last_kv_cache_bytes, 1.0 - kept / dense


def run(args: argparse.Namespace) -> list[Row]:
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"# Qwen2 {n_params / 1e6:.1f}M params ({args.layers} layers, hidden {args.hidden}, {args.heads} q / "
          f"{args.kv_heads} kv heads), batch {args.batch_size}, prompt {args.prompt_len}, {args.device} {args.dtype}, "
          f"{torch.get_num_threads()} threads, buffer {args.buffer}, window {args.window}, {args.clock} clock, "
          f"best of {args.repeats}")
    print(HEADER)
    g = torch.Generator().manual_seed(args.seed)
    prompt_t = torch.randint(0, args.vocab, (args.batch_size, args.prompt_len), generator=g)
    prompts = prompt_t.tolist()

    engines = {("none", 0): EmbeddedEngine(model, KVCompressConfig(method="none"), max_batch_size=args.batch_size,
                                           device=args.device)}
    for method in args.methods:
        for budget in args.budgets:
            kv = KVCompressConfig(method=method, budget=budget, buffer=args.buffer, window=args.window)
            engines[(method, budget)] = EmbeddedEngine(model, kv, max_batch_size=args.batch_size, device=args.device)

    # warm-up: first calls pay one-off costs (allocator, kernels, lazy imports)
    ours(engines[("none", 0)], prompts, 8, args.device, args.seed, clock)
    if not args.no_hf:
        hf_generate(model, prompt_t, 8, args.device, clock)

    rows: list[Row] = []
    for n_new in args.lengths:
        tokens = args.batch_size * n_new
        if not args.no_hf:
            seconds, kv_bytes = min(hf_generate(model, prompt_t, n_new, args.device, clock) for _ in range(args.repeats))
            rows.append(Row(n_new, "hf-generate", "none", "-", tokens / seconds, kv_bytes, 0.0))
            print_row(rows[-1], rows[-1])
        base = None if args.no_hf else rows[-1]
        for (method, budget), engine in engines.items():
            if method != "none" and budget + args.buffer >= args.prompt_len + n_new:
                continue  # the cache would never fill: identical to dense
            seconds, kv_bytes, savings = min(
                ours(engine, prompts, n_new, args.device, args.seed, clock) for _ in range(args.repeats)
            )
            label = str(budget) if budget else "-"
            rows.append(Row(n_new, "embedded", method, label, tokens / seconds, kv_bytes, savings))
            base = base or rows[-1]
            print_row(rows[-1], base)
    return rows


HEADER = ("| new tokens | engine | method | budget | tokens/s | x HF | peak KV MiB | x HF | KV token savings |\n"
          "|---|---|---|---|---|---|---|---|---|")


def print_row(row: Row, base: Row) -> None:
    """One markdown row; ratios are against `base` (the HF row of the same length, else our dense row)."""
    print(f"| {row.length} | {row.engine} | {row.method} | {row.budget} | {row.tokens_per_s:.1f} | "
          f"{row.tokens_per_s / base.tokens_per_s:.2f} | {row.kv_bytes / 2**20:.1f} | "
          f"{row.kv_bytes / base.kv_bytes:.2f} | {row.savings:.1%} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
