"""slime-sparse-eval: pass@1 / avg@k / pass@k on a local dataset, under dense or compressed-KV inference (the
library it calls: modes.py).

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

from .modes import eval_sampling, evaluate, load_eval_sets

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
