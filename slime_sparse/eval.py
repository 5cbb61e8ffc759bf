"""Evaluation: pass@1 / avg@k / pass@k on a local dataset, under dense or compressed-KV inference.

    slime-sparse-eval --hf-checkpoint MODEL --eval-prompt-data test.jsonl --kv-method rkv --kv-budget 512 \
        --n-samples-per-eval-prompt 4 --output report.json
    slime-sparse-eval ... --eval-prompt-data gsm8k gsm8k.jsonl math500 math500.jsonl  # named sets, as slime
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from slime_sparse.types import GenerationOutput


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


OUTPUT_HELP = "where the JSON report is written (its directory is created)"
# What evaluation reads of the run config: these sections whole, and these fields of others (the engine's); every
# other training flag is accepted (a training command line evaluates as it is) and left out of --help.
EVAL_SECTIONS = ("sampling", "kv", "data", "reward", "eval", "sglang")
EVAL_FIELDS = {"train": ("hf_checkpoint", "device", "threads", "bf16", "enable_fp32_lm_head", "seed"),
               "rollout": ("engine", "max_batch_size", "kv_cache_gib", "mem_fraction", "cuda_graph")}


def build_eval_parser() -> argparse.ArgumentParser:
    """--help of slime-sparse-eval: the flags evaluation reads (EVAL_SECTIONS, EVAL_FIELDS) and --output; the
    parser accepts every training flag, shown only in slime-sparse-train --help."""
    from slime_sparse.config import SECTION_TYPES
    from slime_sparse.config_loader import build_parser
    from slime_sparse.flags import flag_for

    parser = build_parser(prog="slime-sparse-eval", description=(
        "Evaluate a model (pass@1, avg@k, pass@k) on --eval-prompt-data (or --prompt-data) under dense or "
        "compressed-KV inference. The flags below are the ones evaluation reads; any other flag of "
        "slime-sparse-train is accepted and ignored, so a training command line evaluates as it is."))
    shown = {flag_for(section, f.name) for section in EVAL_SECTIONS for f in dataclasses.fields(SECTION_TYPES[section])}
    shown |= {flag_for(section, name) for section, names in EVAL_FIELDS.items() for name in names}
    for group in parser._action_groups:
        if group.title not in EVAL_SECTIONS:
            group.description = None  # a group left with no flag then prints nothing
        for action in group._group_actions:
            if action.option_strings and action.option_strings[0].startswith("--") and \
                    action.option_strings[0] not in shown | {"--help", "--config"}:
                action.help = argparse.SUPPRESS
    group = next(g for g in parser._action_groups if g.title == "eval")
    group.add_argument("--output", metavar="PATH", help=f"{OUTPUT_HELP} (default: eval_report.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from slime_sparse.config_loader import accept_negative_numbers, load_config
    from slime_sparse.factory import EngineSpec, build_engine
    from slime_sparse.utils.hf import load_tokenizer
    from slime_sparse.utils.paths import check_writable_file
    from slime_sparse.utils.threads import torch_threads
    from slime_sparse.reward import RewardFailure, get_reward_fn

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_eval_parser().print_help()
        return 0
    pre = accept_negative_numbers(argparse.ArgumentParser(add_help=False))
    pre.add_argument("--output", default="eval_report.json")
    known, rest = pre.parse_known_args(argv)
    # evaluation reads the same flags as training; either data flag names the evaluation set(s)
    if "--prompt-data" not in rest and "--eval-prompt-data" in rest:
        rest += ["--prompt-data", _flag_arguments(rest, "--eval-prompt-data")[-1]]  # a path (the last of a pair)
    elif "--eval-prompt-data" not in rest and "--prompt-data" in rest:
        rest += ["--eval-prompt-data", rest[rest.index("--prompt-data") + 1]]
    try:
        cfg = load_config(rest)
        check_writable_file(known.output, "--output")  # before the evaluation, not after it
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with torch_threads(cfg.train.threads):
        tokenizer = load_tokenizer(cfg.train.hf_checkpoint)
        reward_fn = get_reward_fn(cfg.reward)
        engine = build_engine(EngineSpec.from_run(cfg))
        reports = {}
        try:
            for (name, path), records in zip(cfg.eval.datasets, load_eval_sets(cfg, tokenizer).values()):
                report = evaluate(engine, records, tokenizer, reward_fn, sampling=eval_sampling(cfg),
                                  n_samples=cfg.eval.n_samples_per_eval_prompt, seed=cfg.train.seed)
                reports[report_name(name, path)] = {**report, "model": cfg.train.hf_checkpoint, "data": path,
                                                    "kv": dataclasses.asdict(cfg.kv)}
        except RewardFailure as exc:  # its message holds the grader's traceback
            reward_fn.close()
            print(f"error: {exc}", file=sys.stderr)
            return 1
    # one document, printed as written: {set name: report}
    text = json.dumps(reports, indent=2)
    os.makedirs(os.path.dirname(os.path.abspath(known.output)), exist_ok=True)
    with open(known.output, "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    print(text)
    close = getattr(reward_fn, "close", None)
    if callable(close):
        close()
    return 0


def report_name(name: str, path: str) -> str:
    """The key of a set's report: its --eval-prompt-data NAME, or for one bare PATH the file's name without its
    suffix (`test` for data/test.jsonl)."""
    return name or os.path.splitext(os.path.basename(path))[0]


def _flag_arguments(argv: list[str], flag: str) -> list[str]:
    """The arguments that follow `flag` in `argv` (up to the next flag)."""
    start = argv.index(flag) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


if __name__ == "__main__":
    sys.exit(main())
