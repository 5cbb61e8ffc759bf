"""The long-horizon task: a long worked countdown whose end needs values stated only in the prompt.

    prompt   "15,64,37,82;153+7*26="
    response "26:153+7=160;25:160+7=167;...;1:328+7=335>15,64,37,82#335"   then </s>   (318-396 tokens)
    label    "15,64,37,82#335"

The prompt gives four two-digit keys and an expression start + step * count. A worked answer counts down as
repeated_add's does (every step restates its state, so the chain itself is local), then restates the keys and
the total. The keys are used nowhere in between: after ~350 tokens they are the far-back values a compressed
KV cache drops first (nothing attends to them for the whole chain), so what the cache dropped changes what
the sampler writes at the end of the answer, and the learner (dense) would have written something else.

A bare answer restates the keys at once and guesses the total (">15,64,37,82#335"): the keys are then near,
right under any cache, and the total is a guess. The warm start imitates both (`with_bare_answers`), so GRPO
has a choice to learn. Under dense sampling working pays (the total and the keys are right), under a cache
that drops the keys it pays less: the sampler's best behaviour differs from the dense policy's, the
mechanism by which training on compressed rollouts without a correction trains the learner toward a policy
it is not (Sparse-RL, arXiv 2601.10079).

Reward, with partial credit: 0 unless the response ends with EOS; else 0.5 x [total right] + 0.5 x the
fraction of the four keys restated right in their places. A full score (1.0) is what pass@1 counts.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Iterable

ANSWER_MARK = "#"
KEYS_MARK = ">"
_PROMPT_RE = re.compile(r"(\d+(?:,\d+)*);(\d+)\+(\d+)\*(\d+)=")
_TAIL_RE = re.compile(r">([\d,]*)#(\d+)")  # the end of every well-formed answer, bare or worked
_LABEL_RE = re.compile(r"(\d+(?:,\d+)*)#(\d+)")


@dataclass(frozen=True)
class LongRecallConfig:
    """Inclusive ranges of the prompt's numbers. The defaults give worked answers of 318-396 tokens (mean ~357):
    3-digit totals throughout (start 100-199, at most 199 + 9 x 30 = 469), 24-30 steps of 11-13 tokens."""

    num_keys: int = 4
    min_key: int = 10
    max_key: int = 99
    min_start: int = 100
    max_start: int = 199
    min_step: int = 2
    max_step: int = 9
    min_count: int = 24
    max_count: int = 30

    def validate(self) -> None:
        if self.num_keys < 1:
            raise ValueError(f"num_keys={self.num_keys} must be >= 1")
        if self.max_key - self.min_key + 1 < self.num_keys:
            raise ValueError(f"keys range [{self.min_key}, {self.max_key}] holds fewer than num_keys={self.num_keys}"
                             " distinct values")
        for name, low, high, floor in (("key", self.min_key, self.max_key, 0),
                                       ("start", self.min_start, self.max_start, 0),
                                       ("step", self.min_step, self.max_step, 0),
                                       ("count", self.min_count, self.max_count, 1)):
            if low < floor:
                raise ValueError(f"min_{name}={low} must be >= {floor}")
            if high < low:
                raise ValueError(f"max_{name}={high} must be >= min_{name}={low}")

    @property
    def num_problems(self) -> int:
        """How many distinct prompts the ranges allow (ordered distinct keys x expressions)."""
        keys, n = 1, self.max_key - self.min_key + 1
        for i in range(self.num_keys):
            keys *= n - i
        return (keys * (self.max_start - self.min_start + 1) * (self.max_step - self.min_step + 1)
                * (self.max_count - self.min_count + 1))


def make_prompt(keys: list[int], start: int, step: int, count: int) -> str:
    return f"{','.join(map(str, keys))};{start}+{step}*{count}="


def make_label(keys: list[int], start: int, step: int, count: int) -> str:
    return f"{','.join(map(str, keys))}{ANSWER_MARK}{start + step * count}"


def make_response(keys: list[int], start: int, step: int, count: int) -> str:
    """The worked answer: `left:total+step=new` for left = count..1, then `>keys#total`."""
    steps, total = [], start
    for left in range(count, 0, -1):
        steps.append(f"{left}:{total}+{step}={total + step}")
        total += step
    return ";".join(steps) + KEYS_MARK + make_label(keys, start, step, count)


def bare_response(label: str) -> str:
    """The bare answer to a problem: the keys restated at once, the total written without working."""
    return KEYS_MARK + label


def parse_prompt(prompt: str) -> tuple[list[int], int, int, int]:
    """(keys, start, step, count) of a prompt made by `make_prompt`."""
    match = _PROMPT_RE.fullmatch(prompt)
    if match is None:
        raise ValueError(f"prompt {prompt!r} is not a long-recall prompt 'k1,k2,...;start+step*count='")
    keys = [int(k) for k in match.group(1).split(",")]
    start, step, count = (int(g) for g in match.groups()[1:])
    return keys, start, step, count


def parse_label(label: Any) -> tuple[list[str], str]:
    """(keys, total) of a label 'k1,k2,...#total', as the digit strings they must be written as."""
    match = _LABEL_RE.fullmatch(str(label).strip())
    if match is None:
        raise ValueError(f"label {label!r} is not a long-recall label 'k1,k2,...#total'")
    return match.group(1).split(","), match.group(2)


def generate_dataset(n: int, seed: int, config: LongRecallConfig = LongRecallConfig(),
                     exclude_prompts: Iterable[str] = ()) -> list[dict[str, str]]:
    """`n` distinct problems as {"prompt", "label", "response"} ("response" is the worked answer);
    `exclude_prompts` keeps a split disjoint from another (test from train)."""
    config.validate()
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if n > config.num_problems // 2:  # rejection sampling below would slow to a crawl near the limit
        raise ValueError(f"n={n} is more than half of the {config.num_problems} distinct problems of {config}")
    rng = random.Random(seed)
    seen = set(exclude_prompts)
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        keys = rng.sample(range(config.min_key, config.max_key + 1), config.num_keys)
        args = (keys, rng.randint(config.min_start, config.max_start), rng.randint(config.min_step, config.max_step),
                rng.randint(config.min_count, config.max_count))
        prompt = make_prompt(*args)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "label": make_label(*args), "response": make_response(*args)})
    return rows


def with_bare_answers(rows: list[dict], fraction: float, seed: int) -> list[dict]:
    """A copy of `rows` where a seeded `fraction` answer bare (`bare_response`): the warm start's mixture."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"bare answer fraction={fraction} must lie in [0, 1]")
    rng = random.Random(seed)
    return [dict(r, response=bare_response(r["label"])) if rng.random() < fraction else r for r in rows]


def score(response: str, label: Any) -> tuple[float, float]:
    """(total right: 0 or 1, fraction of keys right in their places) of a response without its EOS.

    The tail `>keys#total` must end the response (a worked answer's steps before it are not graded: a slip
    there shows in the total); keys are compared place by place, missing or extra ones count as wrong.
    """
    want_keys, want_total = parse_label(label)
    text = response.strip()
    match = _TAIL_RE.search(text)
    if match is None or match.end() != len(text) or text.count(KEYS_MARK) != 1 or text.count(ANSWER_MARK) != 1:
        return 0.0, 0.0
    got_keys = match.group(1).split(",")
    right = sum(g == w for g, w in zip(got_keys, want_keys))
    return float(match.group(2) == want_total), right / max(len(want_keys), len(got_keys))


def task_reward(response: str, label: Any, finish_reason: str = "stop", eos_token: str | None = "</s>") -> float:
    """0.5 x [total right] + 0.5 x (fraction of keys right); 0 for a response that did not end with EOS
    (finish_reason "length") and for a malformed one. `eos_token` at the end of `response` is stripped."""
    if finish_reason != "stop":
        return 0.0
    if eos_token and response.endswith(eos_token):
        response = response[: -len(eos_token)]
    total, keys = score(response, label)
    return 0.5 * total + 0.5 * keys
