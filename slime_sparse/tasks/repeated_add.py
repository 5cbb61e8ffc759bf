"""The default embedded task: repeated addition, written out as a counted scratchpad.

    prompt   "42+7*4="
    response "1:42+7=49;2:49+7=56;3:56+7=63;4:63+7=70#70"   then </s>
    label    "70"

The prompt is an expression start + step * count; the response adds `step` to the running total
`count` times, numbering the steps, then writes the value after '#'.

Why this shape (measured on a 2-core CPU while choosing it):
- Responses (~75-140 character tokens) are several times longer than a small KV budget, while
  the prompt stays short (8-9 tokens with <s>).
- Every step needs the running total and the step counter from the previous step (recent) and,
  to decide whether to stop, `count` from the prompt (far back); `step` is both in the prompt and
  in the previous step. A cache that keeps sinks + a recent window loses `count` and the model no
  longer knows when to stop (accuracy ~0.1); one that keeps the prompt and the last 16-24 tokens
  keeps most of the dense accuracy (with the compression-aware warm start, see warm_start.py).
- A tiny model learns it from scratch in ~300 supervised steps (~1.5 min on 2 cores): each token
  is a local operation (increment a counter, copy, add a digit to a short number) or a read from a
  fixed place in the prompt. A running sum over the prompt's digits ("35274=" -> "3+5=8;8+2=10;...")
  was tried first: the model must fetch the k-th prompt digit at step k, an induction-style pointer
  that did not form within 300 steps (loss on those digits 0.9-2.1 nats, chance is 2.2, while the
  arithmetic tokens were learned), so accuracy stayed below 0.1.
- The reward checks only the final answer, so it is verifiable without trusting the scratchpad.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

ANSWER_MARK = "#"
_PROMPT_RE = re.compile(r"(\d+)\+(\d+)\*(\d+)=")
_ANSWER_RE = re.compile(r"#(\d+)")


@dataclass(frozen=True)
class RepeatedAddConfig:
    """Inclusive ranges of the prompt's start value, step (the added number) and count (how many additions)."""

    min_start: int = 10
    max_start: int = 99
    min_step: int = 2
    max_step: int = 9
    min_count: int = 7
    max_count: int = 11

    def validate(self) -> None:
        for name, low, high, floor in (
            ("start", self.min_start, self.max_start, 0),
            ("step", self.min_step, self.max_step, 0),
            ("count", self.min_count, self.max_count, 1),
        ):
            if low < floor:
                raise ValueError(f"min_{name}={low} must be >= {floor}")
            if high < low:
                raise ValueError(f"max_{name}={high} must be >= min_{name}={low}")

    @property
    def num_problems(self) -> int:
        """How many distinct prompts the ranges allow."""
        return (
            (self.max_start - self.min_start + 1)
            * (self.max_step - self.min_step + 1)
            * (self.max_count - self.min_count + 1)
        )


def make_prompt(start: int, step: int, count: int) -> str:
    return f"{start}+{step}*{count}="


def make_response(start: int, step: int, count: int) -> str:
    """The reference scratchpad: `i:total+step=new` for i = 1..count, then `#answer`."""
    steps = []
    total = start
    for i in range(1, count + 1):
        steps.append(f"{i}:{total}+{step}={total + step}")
        total += step
    return ";".join(steps) + f"{ANSWER_MARK}{total}"


def parse_prompt(prompt: str) -> tuple[int, int, int]:
    """(start, step, count) of a prompt made by `make_prompt`."""
    match = _PROMPT_RE.fullmatch(prompt)
    if match is None:
        raise ValueError(f"prompt {prompt!r} is not a repeated-addition prompt 'start+step*count='")
    start, step, count = (int(g) for g in match.groups())
    return start, step, count


def generate_dataset(
    n: int,
    seed: int,
    config: RepeatedAddConfig = RepeatedAddConfig(),
    exclude_prompts: Iterable[str] = (),
) -> list[dict[str, str]]:
    """`n` distinct problems as {"prompt", "label", "response"} ("response" is the reference scratchpad).

    `exclude_prompts` keeps a split disjoint from another (e.g. test from train).
    """
    config.validate()
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = random.Random(seed)
    seen = set(exclude_prompts)
    available = config.num_problems - sum(_in_space(p, config) for p in seen)
    if n > available:
        raise ValueError(
            f"n={n} distinct prompts requested but only {available} are left"
            f" ({config.num_problems} in the ranges of {config}, minus the excluded ones)"
        )
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        start = rng.randint(config.min_start, config.max_start)
        step = rng.randint(config.min_step, config.max_step)
        count = rng.randint(config.min_count, config.max_count)
        prompt = make_prompt(start, step, count)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "label": str(start + step * count), "response": make_response(start, step, count)})
    return rows


def _in_space(prompt: str, config: RepeatedAddConfig) -> bool:
    """Whether `prompt` is one this config can draw (only such exclusions shrink what is left)."""
    try:
        start, step, count = parse_prompt(prompt)
    except ValueError:
        return False
    return (
        config.min_start <= start <= config.max_start
        and config.min_step <= step <= config.max_step
        and config.min_count <= count <= config.max_count
        and prompt == make_prompt(start, step, count)  # no leading zeros
    )


def parse_answer(response: str) -> int | None:
    """The final answer of a response: the digits after the single '#', which must end the text.

    Returns None for a malformed response (no '#', several '#', anything after the number).
    """
    text = response.strip()
    if text.count(ANSWER_MARK) != 1:
        return None
    match = _ANSWER_RE.search(text)
    if match is None or match.end() != len(text):
        return None
    return int(match.group(1))


def task_reward(response: str, label: Any, finish_reason: str = "stop", eos_token: str | None = "</s>") -> float:
    """1.0 iff the response finished with EOS and its final answer equals `label`, else 0.0.

    response: the decoded response; a trailing `eos_token` (decoded without skipping special tokens)
        is stripped first. finish_reason: "stop" when the sampler stopped on EOS; "length" (truncated)
        always scores 0, even when the text happens to end in a correct "#answer".
    """
    if finish_reason != "stop":
        return 0.0
    if eos_token and response.endswith(eos_token):
        response = response[: -len(eos_token)]
    answer = parse_answer(response)
    return float(answer is not None and answer == int(label))


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
