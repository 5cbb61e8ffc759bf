"""Why does sparse training drift to bare answers at 1/4 of the answer? The mechanism, measured without training.

    python examples/tiny_cpu/long_horizon_mechanism.py                       # 512 prompts x 4 samples per arm
    python examples/tiny_cpu/long_horizon_mechanism.py --assets-seed 7       # another data set + warm start

On the study's warm start (long_horizon.py), the first response token chooses between a worked answer (a digit:
the countdown) and a bare one ('#'); it is sampled from a cache that holds only the prompt, so xi = pi_old /
pi_sparse = 1 there under every budget. What moves that choice in one GRPO step is the first token's share of the
loss's gradient. For each estimator this script computes that share exactly, from the project's own advantage,
correction and loss code, on >= 2,048 samples per arm:

    push = mean over prompts p of  sum_{i in p} c_i (1[i worked] - P_p(worked))

the first-order change of the log-odds of a worked first token per unit of learning rate (the first token treated
as the binary choice worked / bare; its logits as free parameters), where c_i = -dLoss/d log pi(first token of i)
(the advantage x the weight x the aggregation's factor, differentiated through `policy_loss`) and P_p(worked) is
the warm start's own probability (digits at the first position). Samples are scaled by the batch size, so a row
reads as a mean per prompt of 4 samples. The dense-sampled reference is dense GRPO: dense rollouts, their rewards,
no correction. 95 % intervals: the per-prompt pushes' mean +- 1.96 standard errors over prompts (normalisers fixed).

Estimators (on R-KV rollouts at each budget): naive (no correction), `mis`, the paper's rule, sequence-level IS
truncated at 2 (verl's decoupled_seq_is) and untruncated (its log clamped at +-20), an importance-weighted baseline
(each group's baseline the self-normalised IS estimate of the dense mean reward, weights prod_t xi_t; GRPO's std
kept), token-sum aggregation (Dr.GRPO's seq-mean-token-sum-norm, a sample's first token weighed as any other token
rather than 1 / its length), and SMD (its PPO term trains pi_shadow, which equals the dense policy at the first token,
and the distillation KL's gradient vanishes there: at the first token it is naive's, computed as such).

Arms are generated resumably (one file per arm and chunk of 64 prompts under --out), then analysed; the table goes
to stdout and <out>/mechanism.json, the plot to <out>/mechanism.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import long_horizon as lh  # noqa: E402  (the study's recipe and assets)

from slime_sparse.algo import AdvantageSpec, CorrectionConfig, LossConfig, compute_advantages, policy_loss  # noqa
from slime_sparse.algo import sparsity_correction  # noqa: E402
from slime_sparse.backends.logprobs import pad_right, response_log_softmax, response_mask  # noqa: E402
from slime_sparse.tasks.assets import build_assets  # noqa: E402

CHUNK = 64  # prompts per generation file: the unit a killed run resumes from
MAX_LEN = int(lh.RECIPE[lh.RECIPE.index("--rollout-max-response-len") + 1])  # Dr.GRPO's norm_len
N_SAMPLES = 4  # the recipe's --n-samples-per-prompt (GRPO's group)
ESTIMATORS = {  # name -> (correction knobs, advantage baseline, --loss-agg-mode)
    "naive": ({}, "group", "seq-mean-token-mean"),
    "mis": ({"preset": "mis"}, "group", "seq-mean-token-mean"),
    "paper": ({"preset": "paper"}, "group", "seq-mean-token-mean"),
    "seq IS, truncated at 2": ({"preset": "decoupled_seq_is"}, "group", "seq-mean-token-mean"),
    "seq IS, untruncated": ({"is_weight": True, "is_level": "sequence"}, "group", "seq-mean-token-mean"),
    "IS-weighted baseline": ({}, "is", "seq-mean-token-mean"),
    "token-sum aggregation": ({}, "group", "seq-mean-token-sum-norm"),
    "SMD": ({}, "group", "seq-mean-token-mean"),
}


def run_config(model_dir: str, train_path: str, budget: int | None):
    from slime_sparse.config_loader import load_config

    kv = ["--kv-method", "none"] if budget is None else ["--kv-method", "rkv", "--kv-budget", str(budget)]
    return load_config(["--hf-checkpoint", model_dir, "--prompt-data", train_path, *lh.RECIPE, *kv])


def generate_arm(cfg, records, out_dir: str, name: str, seed: int) -> list[dict]:
    """Samples of every record under cfg's KV (N_SAMPLES each, sample i of the whole arm drawing from the stream
    (seed, i), whatever the chunking); per sample: prompt, response, sampler log-probs, reward, finish reason, first
    compression start, and for compressed arms the dense recompute pi_old. Resumes chunk by chunk."""
    from slime_sparse.factory import EngineSpec, LearnerSpec, build_engine, build_learner
    from slime_sparse.rollout.pipeline import assign_rewards, to_samples
    from slime_sparse.reward import get_reward_fn
    from slime_sparse.utils.hf import load_tokenizer

    engine = learner = None
    tokenizer, reward_fn = load_tokenizer(cfg.train.hf_checkpoint), get_reward_fn(cfg.reward)
    rows: list[dict] = []
    for c in range(0, len(records), CHUNK):
        path = os.path.join(out_dir, f"{name}-{c // CHUNK:03d}.pt")
        if os.path.isfile(path):
            rows += torch.load(path)
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        engine = engine or build_engine(EngineSpec.from_run(cfg))
        part = records[c:c + CHUNK]
        outputs = engine.generate([r.prompt_ids for r in part for _ in range(N_SAMPLES)], cfg.sampling, seed=seed,
                                  index_offset=c * N_SAMPLES)
        samples = to_samples(part, outputs, N_SAMPLES)
        assign_rewards(samples, tokenizer, reward_fn)
        old = None
        if cfg.kv.enabled:
            learner = learner or build_learner(LearnerSpec.from_run(cfg))
            old = learner.compute_logprobs([s.prompt_ids + s.response_ids for s in samples],
                                           [len(s.response_ids) for s in samples])
        chunk = [{"prompt": s.prompt_index, "prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                  "logp_sparse": s.rollout_logprobs, "logp_old": None if old is None else old[j].tolist(),
                  "reward": s.reward, "finish": s.finish_reason,
                  "first_start": None if s.evictions is None else int(s.evictions.starts[0])}
                 for j, s in enumerate(samples)]
        torch.save(chunk, path + ".tmp")
        os.replace(path + ".tmp", path)
        rows += chunk
        print(f"{name}: prompts {c + len(part)}/{len(records)} ({time.perf_counter() - t0:.0f}s wall, "
              f"{time.process_time() - c0:.0f}s CPU)", flush=True)
    return rows


def worked_probability(model_dir: str, records, hash_id: int) -> torch.Tensor:
    """P_p(first response token is not '#') under the warm start, temperature 1, per prompt."""
    from slime_sparse.utils.hf import load_model

    model = load_model(model_dir, torch.device("cpu"), None)
    out = []
    with torch.inference_mode():
        for c in range(0, len(records), CHUNK):
            part = records[c:c + CHUNK]
            logp, _ = response_log_softmax(model, [r.prompt_ids + [hash_id] for r in part], [1] * len(part))
            out.append(1.0 - logp[:, 0, hash_id].exp())
    return torch.cat(out)


def first_token_coefficients(rows: list[dict], name: str, sparse: bool) -> torch.Tensor:
    """c_i = -dLoss/d log pi(first token of sample i) under estimator `name` (sparse: xi from the recompute; dense
    rows: xi = 1), through the project's advantages, correction and loss."""
    knobs, baseline, agg = ESTIMATORS[name]
    lens = [len(r["response_ids"]) for r in rows]
    mask = response_mask(lens)
    logp_sparse = pad_right([torch.tensor(r["logp_sparse"]) for r in rows], 0.0, dtype=torch.float32)
    logp_old = pad_right([torch.tensor(r["logp_old"]) for r in rows], 0.0, dtype=torch.float32) if sparse \
        else logp_sparse.clone()
    rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
    groups = torch.tensor([r["prompt"] for r in rows])
    adv, _ = compute_advantages(rewards, groups, torch.tensor(lens), AdvantageSpec())
    if baseline == "is":  # the group's baseline: sum_j w_j R_j / sum_j w_j, w_j = prod_t xi_t (self-normalised)
        log_w = ((logp_old - logp_sparse) * mask).sum(-1).clamp(-20, 20)
        std = torch.stack([rewards[groups == g].std() for g in groups])
        base = torch.stack([(torch.softmax(log_w[groups == g], 0) * rewards[groups == g]).sum() for g in groups])
        adv = torch.where(std > 0, (rewards - base) / (std + 1e-6), torch.zeros_like(rewards))  # flat group: 0
    corr = sparsity_correction(logp_old, logp_sparse, mask, CorrectionConfig.from_dict(knobs))
    loss_cfg = LossConfig(loss_agg_mode=agg, norm_len=MAX_LEN if agg.endswith("norm") else None)
    logp = logp_old.clone().requires_grad_(True)  # at pi_theta = pi_old: ratio 1, no clip
    loss, _ = policy_loss(logp, logp_old, adv, corr.mask, loss_cfg, weights=corr.weights)
    loss.backward()
    return -logp.grad[:, 0] * len(rows)  # scaled by the batch: a mean over samples reads per sample


def push(rows: list[dict], coef: torch.Tensor, p_worked: torch.Tensor, hash_id: int) -> tuple[float, float, float]:
    """(mean, 95 % low, high) over prompts of sum_{i in p} c_i (1[worked] - P_p)."""
    worked = torch.tensor([float(r["response_ids"][0] != hash_id) for r in rows])
    prompt = torch.tensor([r["prompt"] for r in rows])
    per = torch.zeros(len(p_worked)).index_add_(0, prompt, coef * (worked - p_worked[prompt]))
    mean, se = per.mean().item(), per.std().item() / math.sqrt(len(per))
    return mean, mean - 1.96 * se, mean + 1.96 * se


def describe_arm(rows: list[dict], hash_id: int) -> dict:
    worked = [r for r in rows if r["response_ids"][0] != hash_id]
    bare = [r for r in rows if r["response_ids"][0] == hash_id]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    xi0 = [abs(r["logp_old"][0] - r["logp_sparse"][0]) for r in rows if r["logp_old"] is not None]
    return {"samples": len(rows), "worked": len(worked) / len(rows), "reward": mean([r["reward"] for r in rows]),
            "reward_worked": mean([r["reward"] for r in worked]), "reward_bare": mean([r["reward"] for r in bare]),
            "length": mean([len(r["response_ids"]) for r in rows]),
            "max_abs_log_xi_first_token": max(xi0) if xi0 else 0.0}


def bare_advantage(rows: list[dict], hash_id: int) -> float:
    """GRPO's mean advantage of the bare samples (the sampler's raw rewards, as the pipeline computes it)."""
    rewards = torch.tensor([r["reward"] for r in rows])
    adv, _ = compute_advantages(rewards, torch.tensor([r["prompt"] for r in rows]),
                                torch.tensor([len(r["response_ids"]) for r in rows]), AdvantageSpec())
    bare = torch.tensor([r["response_ids"][0] == hash_id for r in rows])
    return adv[bare].mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=512, help="training prompts, each sampled 4 times per arm")
    parser.add_argument("--budgets", type=int, nargs="+", default=[87, 117, 175])
    parser.add_argument("--assets-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1, help="the arms' sampling seed (every arm draws the same streams)")
    parser.add_argument("--out", default=None, help="default: runs/long_horizon/mechanism[-assets<S>]")
    parser.add_argument("--cache-dir", default=".cache/tiny_assets")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = args.out or "runs/long_horizon/mechanism" + (f"-assets{args.assets_seed}" if args.assets_seed else "")
    os.makedirs(out, exist_ok=True)
    t0, c0 = time.perf_counter(), time.process_time()
    assets = build_assets(args.cache_dir, lh.assets_config(args.assets_seed))
    from slime_sparse.data.prompt_dataset import PromptDataset
    from slime_sparse.data.stream import record_of
    from slime_sparse.utils.hf import load_tokenizer

    dense_cfg = run_config(str(assets.model_dir), str(assets.train_path), None)
    tokenizer = load_tokenizer(str(assets.model_dir))
    hash_id = tokenizer.convert_tokens_to_ids("#")
    data = PromptDataset(dataclasses.replace(dense_cfg.data, shuffle=False), tokenizer)
    records = [record_of(p, index=i, epoch=0) for i, p in enumerate(data.prompts[: args.prompts])]
    p_worked = worked_probability(str(assets.model_dir), records, hash_id)

    arms = {"dense": generate_arm(dense_cfg, records, out, "dense", args.seed)}
    for b in args.budgets:
        cfg = run_config(str(assets.model_dir), str(assets.train_path), b)
        arms[f"R-KV {b}"] = generate_arm(cfg, records, out, f"rkv{b}", args.seed)

    result = {"prompts": len(records), "samples_per_prompt": N_SAMPLES, "p_worked_first_token": p_worked.mean().item(),
              "arms": {k: {**describe_arm(v, hash_id), "bare_advantage": bare_advantage(v, hash_id)}
                       for k, v in arms.items()}, "push": {}}
    for agg_name, est in (("dense GRPO (seq-mean-token-mean)", "naive"), ("dense GRPO, token-sum", "token-sum aggregation")):
        result["push"].setdefault("dense", {})[agg_name] = push(
            arms["dense"], first_token_coefficients(arms["dense"], est, sparse=False), p_worked, hash_id)
    for b in args.budgets:
        rows = arms[f"R-KV {b}"]
        result["push"][f"R-KV {b}"] = {name: push(rows, first_token_coefficients(rows, name, sparse=True), p_worked,
                                                  hash_id) for name in ESTIMATORS}
    result["seconds"] = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}
    with open(os.path.join(out, "mechanism.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(tables(result))
    print(f"\nplot: {plot(result, os.path.join(out, 'mechanism.png'))}")
    return 0


def tables(result: dict) -> str:
    lines = ["| arm | samples | worked | reward | reward, worked | reward, bare | mean length | GRPO's mean advantage "
             "of bare samples | max \\|log xi\\| at the first token |", "|" + " --- |" * 9]
    for name, a in result["arms"].items():
        lines.append(f"| {name} | {a['samples']} | {a['worked']:.3f} | {a['reward']:.3f} | {a['reward_worked']:.3f} |"
                     f" {a['reward_bare']:.3f} | {a['length']:.0f} | {a['bare_advantage']:+.3f} | "
                     f"{a['max_abs_log_xi_first_token']:.1e} |")
    arms = [k for k in result["push"] if k != "dense"]
    head = "| estimator | " + " | ".join(arms) + " |"
    lines += ["", head, "|" + " --- |" * (len(arms) + 1)]
    for ref, (m, lo, hi) in result["push"]["dense"].items():
        lines.append(f"| reference: {ref}, dense rollouts | " + " | ".join(
            f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}]" for _ in arms) + " |")
    for name in ESTIMATORS:
        lines.append(f"| {name} | " + " | ".join(
            "{:+.4f} [{:+.4f}, {:+.4f}]".format(*result["push"][a][name]) for a in arms) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    arms = [k for k in result["push"] if k != "dense"]
    fig = Figure(figsize=(4.2 * len(arms), 3.8), layout="constrained")
    axes = fig.subplots(1, len(arms), squeeze=False)[0]
    names = list(ESTIMATORS)
    for ax, arm in zip(axes, arms):
        vals = [result["push"][arm][n] for n in names]
        ax.barh(range(len(names)), [m for m, _, _ in vals],
                xerr=[[m - lo for m, lo, _ in vals], [hi - m for m, _, hi in vals]], color="C1")
        ref, lo, hi = result["push"]["dense"]["dense GRPO (seq-mean-token-mean)"]
        ax.axvspan(lo, hi, color="C0", alpha=0.25, label="dense GRPO (95 % CI)")
        ax.axvline(0, color="k", lw=0.8)
        ax.set_yticks(range(len(names)), names, fontsize="small")
        ax.invert_yaxis()
        ax.set_title(f"{arm}: push on log-odds(worked), first token", fontsize="medium")
        ax.legend(fontsize="x-small", loc="lower right")
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=80)
    return path


if __name__ == "__main__":
    sys.exit(main())
