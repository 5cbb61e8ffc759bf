"""The long-horizon task: a long worked countdown whose end needs values stated only in the prompt.

    prompt   "qxmf;153+7*26="
    response "26:153+7=160;25:160+7=167;...;1:328+7=335#335>qxmf"   then </s>   (312-390 tokens)
    label    "335>qxmf"

The prompt gives four keys (distinct letters) and an expression start + step * count. A worked answer counts down as
repeated_add's does (every step restates its state, so the chain itself is local), then gives the total and
restates the keys. The keys are used nowhere in between: after ~350 tokens they are the far-back values a compressed
KV cache drops first (nothing attends to them for the whole chain), so what the cache dropped changes what
the sampler writes at the end of the answer, and the learner (dense) would have written something else.

A bare answer guesses the total and restates the keys at once ("#335>qxmf"): the keys are then near,
right under any cache, and the total is a guess. The warm start imitates both (`with_bare_answers`), so GRPO
has a choice to learn. Under dense sampling working pays (the total and the keys are right), under a cache
that drops the keys it pays less: the sampler's best behaviour differs from the dense policy's, the
mechanism by which training on compressed rollouts without a correction trains the learner toward a policy
it is not (Sparse-RL, arXiv 2601.10079).

Reward, with partial credit: 0 unless the response ends with EOS; else 0.4 x [total right] + 0.6 x the
fraction of the four keys restated right in their places. A full score (1.0) is what pass@1 counts. The weights
put the choice where the mechanism shows (by construction, measured on the default warm start at temperature 1):
a bare answer scores ~0.58 (keys right, the total a guess), a worked one ~0.71 under dense sampling (the total
always right, half the keys) but less than the bare answer once a compressed cache leaves it fewer than ~30 % of
the keys. With equal weights a worked answer would beat a bare one under any cache.
"""
from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from typing import Any, Iterable

from slime_sparse.tasks.repeated_add import check_ranges, countdown

ANSWER_MARK = "#"
KEYS_MARK = ">"
TOTAL_WEIGHT, KEYS_WEIGHT = 0.4, 0.6  # the reward's parts (module docstring)
_PROMPT_RE = re.compile(r"([a-z]+);(\d+)\+(\d+)\*(\d+)=")
_TAIL_RE = re.compile(r"#(\d+)>([a-z]*)")  # the end of every well-formed answer, bare or worked
_LABEL_RE = re.compile(r"(\d+)>([a-z]+)")


@dataclass(frozen=True)
class LongRecallConfig:
    """The keys' alphabet and inclusive ranges of the prompt's numbers. The defaults give worked answers of
    312-390 tokens (mean ~351): 3-digit totals throughout (start 100-199, at most 199 + 9 x 30 = 469), 24-30 steps
    of 11-13 tokens. Keys are single letters: two-digit keys were copied badly by the tiny model even next to
    the prompt (a digit of a key is ambiguous among the prompt's other digits)."""

    num_keys: int = 4
    key_alphabet: str = "abcdefghijklmnopqrstuvwxyz"
    min_start: int = 100
    max_start: int = 199
    min_step: int = 2
    max_step: int = 9
    min_count: int = 24
    max_count: int = 30
    # the warm start's demonstrations count from here: the far copy of the keys is then learned at every distance
    # (a tiny model trained only on 300+-token answers did not learn it in 1500 steps)
    warm_start_min_count: int = 1

    def validate(self) -> None:
        if self.num_keys < 1:
            raise ValueError(f"num_keys={self.num_keys} must be >= 1")
        if len(set(self.key_alphabet)) < self.num_keys or not re.fullmatch("[a-z]+", self.key_alphabet):
            raise ValueError(f"key_alphabet={self.key_alphabet!r} must hold at least num_keys={self.num_keys} "
                             "distinct lowercase letters")
        check_ranges((("start", self.min_start, self.max_start, 0), ("step", self.min_step, self.max_step, 0),
                      ("count", self.min_count, self.max_count, 1),
                      ("count", self.warm_start_min_count, self.max_count, 1)))

    @property
    def num_problems(self) -> int:
        """How many distinct prompts the ranges allow (ordered distinct keys x expressions)."""
        keys, n = 1, len(set(self.key_alphabet))
        for i in range(self.num_keys):
            keys *= n - i
        return (keys * (self.max_start - self.min_start + 1) * (self.max_step - self.min_step + 1)
                * (self.max_count - self.min_count + 1))


def make_prompt(keys: str, start: int, step: int, count: int) -> str:
    return f"{keys};{start}+{step}*{count}="


def make_label(keys: str, start: int, step: int, count: int) -> str:
    return f"{start + step * count}{KEYS_MARK}{keys}"


def make_response(keys: str, start: int, step: int, count: int) -> str:
    """The worked answer: repeated_add's countdown, then `#total>keys`."""
    return countdown(start, step, count) + ANSWER_MARK + make_label(keys, start, step, count)


def bare_response(label: str) -> str:
    """The bare answer to a problem: the total written without working, then the keys restated at once."""
    return ANSWER_MARK + label


def parse_prompt(prompt: str) -> tuple[str, int, int, int]:
    """(keys, start, step, count) of a prompt made by `make_prompt`."""
    match = _PROMPT_RE.fullmatch(prompt)
    if match is None:
        raise ValueError(f"prompt {prompt!r} is not a long-recall prompt 'keys;start+step*count='")
    start, step, count = (int(g) for g in match.groups()[1:])
    return match.group(1), start, step, count


def parse_label(label: Any) -> tuple[str, str]:
    """(keys, total) of a label 'total>keys', the total as the digit string it must be written as."""
    match = _LABEL_RE.fullmatch(str(label).strip())
    if match is None:
        raise ValueError(f"label {label!r} is not a long-recall label 'total>keys'")
    return match.group(2), match.group(1)


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
        keys = "".join(rng.sample(sorted(set(config.key_alphabet)), config.num_keys))
        args = (keys, rng.randint(config.min_start, config.max_start), rng.randint(config.min_step, config.max_step),
                rng.randint(config.min_count, config.max_count))
        prompt = make_prompt(*args)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "label": make_label(*args), "response": make_response(*args)})
    return rows


def warm_start_demos(train: list[dict], test: list[dict], config: LongRecallConfig, fraction: float,
                     seed: int) -> list[dict]:
    """The warm start's demonstrations: as many problems as `train`, counting from `config.warm_start_min_count`
    (disjoint from both splits), a seeded `fraction` of them answered bare (`with_bare_answers`)."""
    if config.warm_start_min_count == config.min_count:
        rows = train
    else:
        wide = dataclasses.replace(config, min_count=config.warm_start_min_count)
        rows = generate_dataset(len(train), seed + 2, wide, (r["prompt"] for r in train + test))
    return with_bare_answers(rows, fraction, seed)


def with_bare_answers(rows: list[dict], fraction: float, seed: int) -> list[dict]:
    """A copy of `rows` where a seeded `fraction` answer bare (`bare_response`): the warm start's mixture."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"bare answer fraction={fraction} must lie in [0, 1]")
    rng = random.Random(seed)
    return [dict(r, response=bare_response(r["label"])) if rng.random() < fraction else r for r in rows]


def score(response: str, label: Any) -> tuple[float, float]:
    """(total right: 0 or 1, fraction of keys right in their places) of a response without its EOS.

    The tail `#total>keys` must end the response (a worked answer's steps before it are not graded: a slip
    there shows in the total); keys are compared place by place, missing or extra ones count as wrong.
    """
    want_keys, want_total = parse_label(label)
    text = response.strip()
    match = _TAIL_RE.search(text)
    if match is None or match.end() != len(text) or text.count(KEYS_MARK) != 1 or text.count(ANSWER_MARK) != 1:
        return 0.0, 0.0
    got_keys = match.group(2)
    right = sum(g == w for g, w in zip(got_keys, want_keys))
    return float(match.group(1) == want_total), right / max(len(want_keys), len(got_keys))


def task_reward(response: str, label: Any, finish_reason: str = "stop", eos_token: str | None = "</s>") -> float:
    """0.4 x [total right] + 0.6 x (fraction of keys right); 0 for a response that did not end with EOS
    (finish_reason "length") and for a malformed one. `eos_token` at the end of `response` is stripped."""
    if finish_reason != "stop":
        return 0.0
    if eos_token and response.endswith(eos_token):
        response = response[: -len(eos_token)]
    total, keys = score(response, label)
    return TOTAL_WEIGHT * total + KEYS_WEIGHT * keys
