"""The default embedded task: repeated addition, worked as a countdown scratchpad that restates its state.

    prompt   "42+7*4="
    response "4:42+7=49;3:49+7=56;2:56+7=63;1:63+7=70#70"   then </s>
    label    "70"

The prompt is an expression start + step * count; the response adds `step` to the running total `count`
times, each step written as `left:total+step=new` with `left` counting down to 1, then the value after '#'.

Why this shape (measured on a 2-core CPU while choosing it):
- Every step restates all the state the next one needs (steps left, running total, the addend), as a
  chain of thought carries its intermediate results forward: after the first step nothing far back is
  needed. A KV cache that keeps the recent ~2 steps loses little; a budget below one step's worth
  loses the thread. With R-KV at budget 24 + buffer 8 (window 8) a dense-warm-started model has a
  sampler/learner mismatch of ~0.05 nats per token (k3) and saves ~35 % of the KV tokens; at budget 16
  the mismatch is ~0.4 nats and the task breaks (the paper's regime is ~0.01-0.1). A warm start that
  trains a quarter of its sequences under a prompt + recent-window mask (the default assets) brings
  budget 16 down to ~0.08 nats with ~48 % of the KV tokens saved: the tiny recipe's setting.
- Worked answers are 35-85 character tokens (count 3-7), several times the prompt (8-9 tokens with <s>).
- A tiny model learns it from scratch in a few hundred supervised steps: every token is a local
  operation (decrement a digit, copy, add a one-digit number to a short one).
- An earlier version counted up (`1:..;2:..`), so stopping needed `count` from the prompt, far back: a
  cache that dropped the prompt lost it, and RL on ~100-token answers did not raise accuracy.
- The reward checks only the final answer, so it is verifiable without trusting the scratchpad. A bare
  answer ("#70", see `with_direct_answers`) is well-formed too, and right only when the guess is.
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
    min_count: int = 3
    max_count: int = 7

    def validate(self) -> None:
        check_ranges((("start", self.min_start, self.max_start, 0), ("step", self.min_step, self.max_step, 0),
                      ("count", self.min_count, self.max_count, 1)))

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


def check_ranges(ranges: Iterable[tuple[str, int, int, int]]) -> None:
    """(name, min, max, floor) per inclusive range of a task config: min >= floor and max >= min."""
    for name, low, high, floor in ranges:
        if low < floor:
            raise ValueError(f"min_{name}={low} must be >= {floor}")
        if high < low:
            raise ValueError(f"max_{name}={high} must be >= min_{name}={low}")


def countdown(start: int, step: int, count: int) -> str:
    """The worked steps: `left:total+step=new` for left = count..1, each restating the running total."""
    return ";".join(f"{left}:{start + step * i}+{step}={start + step * (i + 1)}"
                    for i, left in enumerate(range(count, 0, -1)))


def make_response(start: int, step: int, count: int) -> str:
    """The reference scratchpad: the countdown, then `#answer`."""
    return countdown(start, step, count) + f"{ANSWER_MARK}{start + step * count}"


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


def with_direct_answers(rows: list[dict], fraction: float, seed: int) -> list[dict]:
    """A copy of `rows` where a seeded `fraction` of them answer at once ("#70", no scratchpad).

    Used for the warm start's demonstrations: the model imitates both styles, and the bare answer is a guess
    for a model this small (it cannot add `count` times in one token), so RL has a choice to learn.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"direct answer fraction={fraction} must lie in [0, 1]")
    rng = random.Random(seed)
    return [dict(r, response=f"{ANSWER_MARK}{r['label']}") if rng.random() < fraction else r for r in rows]


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
