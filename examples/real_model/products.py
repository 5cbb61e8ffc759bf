"""The task SmolLM2-135M-Instruct can learn here: reasoning-gym `products`, 2 factors of 1 digit.

docs/architecture.md ("The real-model task") has the measurement: with the system message below, reading the
answer from the last "Answer:" line or else the last integer, the model scores ~0.4 at temperature 0.7 with most
groups of 4 samples mixed (a GRPO gradient), ~0.8 greedy. The space holds 100 distinct problems (0-9 x 0-9), so the
evaluation set is all of them and training samples from the same space: the recipe measures whether RL
raises accuracy on the task, not generalisation.

    python examples/real_model/products.py --out-dir .cache/real_model/data   # train.jsonl + eval.jsonl

Rows are ordinary `--prompt-data` jsonl: {"prompt": [system, user messages], "label": "45"} (read with
--apply-chat-template). `reward` is the grader, named with --custom-rm-path products:reward.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

try:  # at import: grader workers import this module at start-up, so no timed call pays for it (~1.5 s CPU)
    import reasoning_gym
except ImportError:  # the recipe's flags can still be parsed and checked without it
    reasoning_gym = None

SYSTEM = ("Solve the problem, thinking briefly step by step. On the last line write 'Answer: ' "
          "followed by only the final answer.")
TASK = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)

_ANSWER_LINE = re.compile(r"^\W*answer\W*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_INTEGER = re.compile(r"[-+]?\d[\d,]*")


def rows(n: int, seed: int) -> list[dict[str, Any]]:
    """n problems from reasoning-gym (seeded), as chat-message prompt rows."""
    _require_reasoning_gym()
    data = reasoning_gym.create_dataset("products", size=n, seed=seed, **TASK)
    return [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": x["question"]}],
             "label": x["answer"]} for x in data]


def all_problems() -> list[dict[str, Any]]:
    """Each of the 100 distinct problems once (the evaluation set), in a fixed order."""
    seen: dict[str, dict[str, Any]] = {}
    for row in rows(2000, seed=0):
        seen.setdefault(row["prompt"][1]["content"], row)
    return [seen[q] for q in sorted(seen)]


def extract_answer(response: str) -> str | None:
    """The text after the last "Answer:" line, else the last integer of the response, else None."""
    lines = _ANSWER_LINE.findall(response)
    if lines:
        return lines[-1].strip().rstrip(".").strip("*$ ")
    numbers = _INTEGER.findall(response)
    return numbers[-1].rstrip(",") if numbers else None


def reward(response: str, label: Any, **kwargs: Any) -> float:
    """1.0 when the extracted answer is exactly right under reasoning-gym's own `products` scorer, else 0.
    (That scorer gives partial credit, e.g. 0.67 for "-45" against "45": only full credit counts here.)"""
    _require_reasoning_gym()
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    score = reasoning_gym.get_score_answer_fn("products")(answer, {"answer": str(label)})
    return 1.0 if score >= 1.0 else 0.0


def _require_reasoning_gym() -> None:
    if reasoning_gym is None:
        raise RuntimeError('the products task needs reasoning-gym: pip install "slime_sparse[real]"')


def write_jsonl(path: str, data: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in data:
            fh.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=".cache/real_model/data")
    p.add_argument("--n-train", type=int, default=4096, help="training rows (sampled with repetition from the 100)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    write_jsonl(os.path.join(args.out_dir, "train.jsonl"), rows(args.n_train, args.seed))
    write_jsonl(os.path.join(args.out_dir, "eval.jsonl"), all_problems())
    print(f"wrote {args.out_dir}/train.jsonl ({args.n_train} rows) and eval.jsonl (100 rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
