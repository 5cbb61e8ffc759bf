"""Rewards selected by `--rm-type` / `--custom-rm-path`.

    from slime_sparse.reward import RewardConfig, get_reward_fn
    with get_reward_fn(RewardConfig(rm_type="math", timeout_s=5.0, num_workers=2)) as reward_fn:
        rewards, counters = reward_fn(responses, labels)   # counters: graded / errors / timeouts

Built-in graders: "math" (the authors' boxed-answer + MATH normalisation + sympy grader, math_grader.py)
and "math_verify" (HF math-verify, math_verify_grader.py). Add a task's grader with
`@register_reward("name")` on a module-level `fn(response: str, label, **kwargs) -> float`, or name it
with `--custom-rm-path module.path:function`. Rewards are 1.0 (correct) / 0.0; a grader that raises or
runs past `timeout_s` scores 0 and is counted, never propagated.
"""

from slime_sparse.reward.config import RewardConfig, load_custom_reward
from slime_sparse.reward.math_grader import grade_math, is_equivalent, last_boxed_answer
from slime_sparse.reward.math_verify_grader import grade_math_verify
from slime_sparse.reward.pool import GradeOutcome, GraderPool
from slime_sparse.reward.registry import Grader, get_registered_reward, register_reward, registered_rewards
from slime_sparse.reward.reward_fn import RewardFailure, RewardFn, RewardFunction, RewardStats, get_reward_fn

__all__ = [
    "Grader",
    "GradeOutcome",
    "GraderPool",
    "RewardConfig",
    "RewardFn",
    "RewardFailure",
    "RewardFunction",
    "RewardStats",
    "get_registered_reward",
    "get_reward_fn",
    "grade_math",
    "grade_math_verify",
    "is_equivalent",
    "last_boxed_answer",
    "load_custom_reward",
    "register_reward",
    "registered_rewards",
]
