"""Fuzz of the reward: answers built to make sympy or math-verify hang or eat memory.

Through the real reward function (worker processes, timeout, memory cap), every answer must come back as a
reward in {0, 1} with its status counted (graded / errors / timeouts), and a batch must come back within
its time bound: ceil(answers / workers) timeouts plus start-up slack, so no answer can stall a training step.
The default run grades the hostile answers with `math` and a third of them with `math_verify` (whose timeouts
cost a worker restart each); `-m slow` grades all of them with both and adds a seeded generator of mutations
(FULL_RANDOM answers per grader).
"""
from __future__ import annotations

import math
import random
import time

import pytest

from slime_sparse.reward import RewardConfig, get_reward_fn

TIMEOUT_S = 3.0
WORKERS = 2
FULL_RANDOM = 200

HOSTILE = [
    r"\boxed{10^{10^{10}}}",  # a 10-billion-digit integer if evaluated
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    r"The answer is \boxed{10**10**10}",
    r"\boxed{(x+1)^{100000}}",
    r"\boxed{(x+y+z)^{5000}}",
    r"\boxed{100000!}",
    r"\boxed{(10^{8})!}",
    r"\boxed{\frac{1}{0}}",
    r"\boxed{0/0}",
    r"\boxed{\infty - \infty}",
    r"\boxed{\sum_{n=1}^{10^{12}} n}",
    r"\boxed{\prod_{k=1}^{10^{9}} k}",
    r"\boxed{\int_0^\infty e^{-x^2} dx}",
    r"\boxed{e^{e^{e^{e^{10}}}}}",
    r"\boxed{10^{-10^{10}}}",
    r"\boxed{1e999999999}",
    r"\boxed{\sqrt{" * 300 + "2" + "}" * 300 + "}",
    r"\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    r"\boxed{" + r"\frac{1}{" * 1000 + "2" + "}" * 1000 + "}",
    r"\boxed{" + "1+" * 20000 + "1}",
    r"\boxed{" + "9" * 200000 + "}",
    r"\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    r"\boxed{x^{x^{x^{x^{x}}}}}",
    r"\boxed{\begin{pmatrix}" + "&".join(["1"] * 200) + r"\end{pmatrix}^{1000}}",
    r"\boxed{\lim_{x\to 0} \frac{\sin x}{x}}",
    r"\boxed{nan}",
    r"\boxed{}",
    r"\boxed{",
    "\x00\x01\x02\\boxed{1}\udcff",
    "a" * 1_000_000,
    r"\boxed{1}" * 20000,
    r"\boxed{\text{" + "x" * 100000 + "}}",
    r"\boxed{__import__('os').system('echo pwned')}",
    r"\boxed{().__class__.__base__.__subclasses__()}",
    "1",
]
LABELS = ["1", r"\frac{1}{2}", "10^{10^{10}}", "(1, 2)"]


def mutations(seed: int, n: int) -> list[str]:
    """Random splices of hostile fragments: towers, factorials, deep nesting, long numbers."""
    rng = random.Random(seed)
    parts = [r"10^{", "9^{", "{", "}", r"\frac{", "!", "(", ")", "x", "+", "*", "^", "99999", r"\sqrt{",
             r"\infty", "e", r"\pi", "/", "0", "=", ",", r"\left(", r"\right)", r"\cdot", "-"]
    out = []
    for _ in range(n):
        body = "".join(rng.choice(parts) * rng.choice([1, 1, 2, 50]) for _ in range(rng.randint(1, 40)))
        out.append(rf"\boxed{{{body}}}")
    return out


def grade_batch(rm_type: str, answers: list[str], labels: list[str]) -> tuple[list[float], dict, float, float]:
    """(rewards, counters, seconds of the call, seconds a worker takes to start)."""
    # hostile answers fail by design: counted, never stopping the batch
    config = RewardConfig(rm_type=rm_type, timeout_s=TIMEOUT_S, num_workers=WORKERS, max_error_rate=1.0)
    t0 = time.monotonic()
    with get_reward_fn(config) as reward_fn:
        reward_fn(["warm-up"], ["1"])  # workers started and their grader imported
        startup_s = time.monotonic() - t0
        t1 = time.monotonic()
        rewards, counters = reward_fn(answers, labels)
        return rewards, counters, time.monotonic() - t1, startup_s


def check(rm_type: str, answers: list[str]) -> dict:
    labels = [LABELS[i % len(LABELS)] for i in range(len(answers))]
    rewards, counters, seconds, startup_s = grade_batch(rm_type, answers, labels)
    print(f"{rm_type}: {len(answers)} answers in {seconds:.1f} s (worker start-up {startup_s:.1f} s): {counters}")
    assert all(r in (0.0, 1.0) for r in rewards), rewards
    assert sum(counters.values()) == len(answers)  # every answer counted once: graded, error or timeout
    # an answer costs its worker at most TIMEOUT_S, plus a fresh worker's start-up when it was killed
    bound = math.ceil(len(answers) / WORKERS) * (TIMEOUT_S + 1.5 * startup_s) + 10.0
    assert seconds < bound, (seconds, bound, counters)
    return counters


@pytest.mark.parametrize("rm_type, answers", [
    ("math", HOSTILE),
    ("math_verify", HOSTILE[:8] + HOSTILE[-6:]),  # all of them: ~2 minutes on 2 cores, in the slow set
    pytest.param("math_verify", HOSTILE, marks=pytest.mark.slow, id="math_verify-all"),
])
def test_hostile_answers_score_zero_in_bounded_time(rm_type, answers):
    counters = check(rm_type, answers)
    assert counters["graded"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("rm_type", ["math", "math_verify"])
def test_random_hostile_answers(rm_type):
    check(rm_type, mutations(seed=len(rm_type), n=FULL_RANDOM))
