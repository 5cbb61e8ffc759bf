"""The evaluation library: pass@1 / avg@k / pass@k of a model on local datasets, under dense or compressed-KV
inference. The training loop calls `evaluate_modes` (every --eval-interval rollouts); `slime-sparse-eval` (cli.py)
calls `evaluate` on a model directory or checkpoint.
"""
from __future__ import annotations

import dataclasses
import time

from slime_sparse.kv.config import KVCompressConfig
from slime_sparse.types import GenerationOutput

EVAL_KV = {"dense": KVCompressConfig(method="none")}  # evaluation modes besides "sparse" (`sparse_eval_kv`)


def score_outputs(outputs: list[GenerationOutput], rewards: list[float], n_samples: int) -> dict[str, float]:
    """pass@1 = mean correctness of each prompt's first sample; avg@k = mean over all k samples;
    pass@k = fraction of prompts with at least one correct sample (k = n_samples)."""
    n_prompts = len(outputs) // n_samples
    groups = [rewards[i * n_samples:(i + 1) * n_samples] for i in range(n_prompts)]
    correct = [[r >= 1.0 for r in g] for g in groups]
    kept = sum(o.kv.kept_kv_tokens for o in outputs)
    dense = sum(o.kv.dense_kv_tokens for o in outputs)
    return {
        "pass@1": sum(c[0] for c in correct) / n_prompts,
        f"avg@{n_samples}": sum(sum(c) for c in correct) / (n_prompts * n_samples),
        f"pass@{n_samples}": sum(any(c) for c in correct) / n_prompts,
        "reward_mean": sum(rewards) / len(rewards),
        "response_len_mean": sum(len(o.response_ids) for o in outputs) / len(outputs),
        "kv_savings": 1.0 - kept / dense if dense else 0.0,
        "n_prompts": float(n_prompts),
    }


def evaluate(engine, records: list, tokenizer, reward_fn, *, sampling, n_samples: int = 1, seed: int = 0) -> dict:
    prompts = [r.prompt_ids for r in records for _ in range(n_samples)]
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, sampling, seed=seed)
    elapsed = time.perf_counter() - t0
    texts = tokenizer.batch_decode([o.response_ids for o in outputs], skip_special_tokens=True)
    labels = [r.label for r in records for _ in range(n_samples)]
    rewards, counters = reward_fn(texts, labels, [{"finish_reason": o.finish_reason} for o in outputs])
    report = score_outputs(outputs, list(rewards), n_samples)
    report["seconds"] = elapsed
    report.update({f"reward/{k}": float(v) for k, v in counters.items()})
    return report


def load_eval_sets(cfg, tokenizer) -> dict[str, list]:
    """The evaluation prompts of each --eval-prompt-data set ({name: records}; "" for one bare path), in file
    order, at most --eval-max-prompts of each (none without the flag)."""
    from slime_sparse.data.prompt_dataset import PromptDataset

    sets = {}
    for name, path in cfg.eval.datasets:
        data = PromptDataset(dataclasses.replace(cfg.data, prompt_data=path, shuffle=False), tokenizer)
        records = [data[i] for i in range(len(data))]
        sets[name] = records[: cfg.eval.eval_max_prompts] if cfg.eval.eval_max_prompts else records
    return sets


def eval_sampling(cfg):
    """The rollout's sampling with slime's --eval-* overrides (temperature, top-p / top-k, response budget)."""
    ev, sampling = cfg.eval, cfg.sampling
    return dataclasses.replace(
        sampling, temperature=ev.eval_temperature,
        top_p=sampling.top_p if ev.eval_top_p is None else ev.eval_top_p,
        top_k=sampling.top_k if ev.eval_top_k is None else ev.eval_top_k,
        max_new_tokens=sampling.max_new_tokens if ev.eval_max_response_len is None else ev.eval_max_response_len,
    )


def sparse_eval_kv(cfg):
    """The KV compression of the "sparse" evaluation: the rollout's, or `--eval-kv-method` with the rollout's
    --kv-* knobs (a dense-trained policy evaluated under compression); None when neither compresses."""
    if cfg.eval.eval_kv_method:
        return dataclasses.replace(cfg.kv, method=cfg.eval.eval_kv_method)  # validated with the config
    return cfg.kv if cfg.kv.enabled else None


def eval_kv(cfg, mode: str):
    """The KV compression of evaluation mode `mode`: "sparse" (`sparse_eval_kv`) or one of EVAL_KV's."""
    return sparse_eval_kv(cfg) if mode == "sparse" else EVAL_KV[mode]


def eval_key(mode: str, name: str) -> str:
    """Where the evaluation of set `name` under `mode` is reported: "dense", or "dense/<name>" for a named set
    (metrics "eval_<key>/<metric>")."""
    return f"{mode}/{name}" if name else mode


def evaluate_modes(cfg, components, *, step: int, logger=None) -> dict[str, dict]:
    """Evaluate the current weights on every evaluation set under dense inference and, when compression is on,
    under it (or --eval-kv-method's) too; returns {eval_key(mode, name): report}."""
    modes = ["dense", "sparse"] if sparse_eval_kv(cfg) is not None else ["dense"]
    out = {}
    for mode in modes:
        engine = components.eval_engine(mode)  # shares the rollout engine's (synced) weights
        for name, records in components.eval_sets.items():
            key = eval_key(mode, name)
            out[key] = evaluate(engine, records, components.tokenizer, components.reward_fn,
                                sampling=eval_sampling(cfg), n_samples=cfg.eval.n_samples_per_eval_prompt,
                                seed=cfg.train.seed + step)
            if logger is not None:
                logger.log(step, {f"eval_{key}/{k}": v for k, v in out[key].items()})
    return out
