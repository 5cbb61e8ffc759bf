"""The ablations' row on the real model: what each correction rule rejects on SmolLM2-135M-Instruct's own rollouts.

    python examples/real_model/rejection_rules.py                 # one seed, the table of README.md
    python examples/real_model/rejection_rules.py --seed 2 --prompts 8

One rollout of the real-model recipe (16 products problems x 4 samples, temperature 0.7, chat template, up to 128
new tokens) per KV setting: dense (the control), and R-KV at 1/4, 1/2 and 1 x the mean response length of the
dense rollout (buffer 16, window 8; the recipe's own budget is 32). On each rollout the learner recomputes the
dense pi_old and the shadow pi_shadow (under the sampler's eviction records), and every rule of the tiny recipe's
ablations (examples/tiny_cpu/ablations.py) judges the same samples: the share of sequences and tokens it rejects,
the mismatch (k3) and its sparsity / numeric split. No training: the table reads rejection, not learning (the
training side of the ablations is the tiny recipe's; a real-model training run is run.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from slime_sparse.algo import CorrectionConfig, LossConfig, mismatch_metrics, sparsity_correction  # noqa: E402
from slime_sparse.algo.metrics import mismatch_split_metrics  # noqa: E402
from slime_sparse.backends.batching import MicroBatching  # noqa: E402
from slime_sparse.backends.embedded.learner import EmbeddedLearner  # noqa: E402
from slime_sparse.backends.logprobs import pad_right, response_mask  # noqa: E402
from slime_sparse.backends.optimizer import OptimConfig  # noqa: E402
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.rollout.pipeline import group_advantages, sampler_logprobs, shadow_logprobs_for_split, to_samples  # noqa: E402
from slime_sparse.rollout import SamplingParams  # noqa: E402
from slime_sparse.rollout.embedded import EmbeddedEngine  # noqa: E402

TEMPERATURE = 0.7
# the rules of examples/tiny_cpu/ablations.py
RULES: dict[str, CorrectionConfig] = {
    "none": CorrectionConfig.from_preset("none"),
    "mis, veto 1e-5": CorrectionConfig.from_preset("mis", seq_veto=1e-5),
    "mis (veto 1e-4)": CorrectionConfig.from_preset("mis"),
    "mis, veto 1e-3": CorrectionConfig.from_preset("mis", seq_veto=1e-3),
    "sequence (decoupled_seq_is_rs)": CorrectionConfig.from_preset("decoupled_seq_is_rs"),
    "geometric (decoupled_geo_rs)": CorrectionConfig.from_preset("decoupled_geo_rs"),
}


def prompts(tokenizer, n: int, seed: int):
    import products

    from slime_sparse.data.prompt_dataset import PromptRecord

    rows = products.all_problems()
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(rows), generator=g)[:n].tolist()
    out = []
    for i, j in enumerate(pick):
        text = tokenizer.apply_chat_template(rows[j]["prompt"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(PromptRecord(index=i, prompt_ids=ids, prompt_text=text, label=rows[j]["label"], metadata={},
                                epoch=0, row=j))
    return out


def rollout(model, kv: KVCompressConfig, records, n: int, seed: int, tokenizer):
    import products

    engine = EmbeddedEngine(model, kv, max_batch_size=len(records) * n)
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=128, stop_token_ids=(eos,))
    outs = engine.generate([r.prompt_ids for r in records for _ in range(n)], params, seed=seed)
    samples = to_samples(records, outs, n)
    for s in samples:
        s.reward = products.reward(tokenizer.decode(s.response_ids, skip_special_tokens=True), s.label)
    return samples


def judge(samples, learner) -> dict[str, dict[str, float]]:
    tokens = [s.prompt_ids + s.response_ids for s in samples]
    lens = [len(s.response_ids) for s in samples]
    old = learner.compute_logprobs(tokens, lens)
    shadow = shadow_logprobs_for_split(samples, learner, old)
    pad = lambda xs: pad_right(xs, 0.0, dtype=torch.float32)  # noqa: E731
    logp_old, logp_sparse, mask = pad(old), sampler_logprobs(samples), response_mask(lens)
    split = mismatch_split_metrics(logp_old, pad(shadow), logp_sparse, mask)
    total = mismatch_metrics(logp_old, logp_sparse, mask)
    adv = group_advantages(samples, True)[0]
    out = {}
    for name, cfg in RULES.items():
        m = sparsity_correction(logp_old, logp_sparse, mask, cfg, advantages=adv).metrics
        out[name] = {"seq": m["correction/seq_reject_rate"], "tok": m["correction/token_reject_rate"]}
    out["_"] = {**total, **split, "len": sum(lens) / len(lens), "reward": sum(s.reward for s in samples) / len(samples),
                "savings": 1 - sum(s.kv.kept_kv_tokens for s in samples) / max(sum(s.kv.dense_kv_tokens for s in samples), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_sparse.utils.gguf import smollm2_hf_dir

    t0 = time.perf_counter()
    model_dir = str(smollm2_hf_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    learner = EmbeddedLearner(model, LossConfig(), optim=OptimConfig(lr=1e-6), batching=MicroBatching(max_tokens=4096),
                              temperature=TEMPERATURE)
    records = prompts(tokenizer, args.prompts, args.seed)

    results = {}
    dense = rollout(model, KVCompressConfig(method="none"), records, args.samples, args.seed, tokenizer)
    results["dense (control)"] = judge(dense, learner)
    mean_len = results["dense (control)"]["_"]["len"]
    print(f"# SmolLM2-135M-Instruct, {args.prompts} prompts x {args.samples} samples, seed {args.seed}; dense mean "
          f"response {mean_len:.1f} tokens; {time.perf_counter() - t0:.0f}s so far", flush=True)
    for frac, label in ((0.25, "1/4"), (0.5, "1/2"), (1.0, "1")):
        budget = max(9, round(frac * mean_len))  # R-KV needs budget > window (8)
        kv = KVCompressConfig(method="rkv", budget=budget, buffer=16, window=8)
        results[f"R-KV {budget} ({label})"] = judge(rollout(model, kv, records, args.samples, args.seed, tokenizer),
                                                    learner)

    head = ["KV", "reward", "resp. len", "KV saved", "k3", "sparsity k3", "numeric k3", "xi p5",
            *(f"{name}: seq / tok" for name in RULES)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for kv_name, r in results.items():
        m = r["_"]
        cells = [kv_name, f"{m['reward']:.2f}", f"{m['len']:.1f}", f"{m['savings']:.2f}", f"{m['mismatch/k3']:.3f}",
                 f"{m['mismatch/sparsity/k3']:.3f}", f"{m['mismatch/numeric/k3']:.0e}", f"{m['mismatch/xi_p5']:.3f}",
                 *(f"{r[name]['seq']:.2f} / {r[name]['tok']:.2f}" for name in RULES)]
        print("| " + " | ".join(cells) + " |")
    print(f"\n({time.perf_counter() - t0:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
