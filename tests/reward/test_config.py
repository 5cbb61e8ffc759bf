"""RewardConfig validation, the --rm-type registry and --custom-rm-path loading."""

from __future__ import annotations

import sys
import textwrap

import pytest

from slime_sparse.reward import (
    RewardConfig,
    get_registered_reward,
    get_reward_fn,
    grade_math,
    load_custom_reward,
    register_reward,
    registered_rewards,
)

CUSTOM_MODULE = textwrap.dedent(
    """
    def exact(response, label, **kwargs):
        return 1.0 if response.strip() == str(label) else 0.0

    class Graders:
        @staticmethod
        def length(response, label, **kwargs):
            return float(len(response))

    async def async_grader(response, label, **kwargs):
        return 1.0

    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    """A user module `my_task_rewards` importable from a temporary directory (also by worker processes)."""
    (tmp_path / "my_task_rewards.py").write_text(CUSTOM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_task_rewards"
    sys.modules.pop("my_task_rewards", None)  # the next test's copy lives in another tmp_path


def test_builtins_are_registered():
    assert {"math", "math_verify"} <= set(registered_rewards())
    assert get_registered_reward("math") is grade_math
    RewardConfig().validate()
    RewardConfig(rm_type="math_verify").validate()


def test_unknown_rm_type_names_the_flag():
    with pytest.raises(ValueError, match=r"--rm-type 'gsm9k' is not a registered reward.*'math'"):
        RewardConfig(rm_type="gsm9k").check_inputs()
    with pytest.raises(ValueError, match="--rm-type"):
        RewardConfig(rm_type="  ").validate()
    with pytest.raises(ValueError, match="--rm-type"):
        get_reward_fn(RewardConfig(rm_type="gsm9k"))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("timeout_s", 0.0, "--rm-timeout"),
        ("timeout_s", float("nan"), "--rm-timeout"),
        ("num_workers", -1, "--rm-num-workers"),
        ("num_workers", 1.5, "--rm-num-workers"),
        ("max_error_rate", 1.5, "--rm-max-error-rate"),
        ("max_error_rate", -0.1, "--rm-max-error-rate"),
    ],
)
def test_bad_numbers(field, value, match):
    with pytest.raises(ValueError, match=match):
        RewardConfig(**{field: value}).validate()


def test_custom_path_both_spellings(custom_module):
    fn = load_custom_reward(f"{custom_module}:exact")
    assert fn("42", 42) == 1.0 and fn("41", 42) == 0.0
    assert load_custom_reward(f"{custom_module}.exact") is fn  # slime's dotted form
    assert load_custom_reward(f"{custom_module}:Graders.length")("abc", None) == 3.0


@pytest.mark.parametrize(
    "path, match",
    [
        (
            "no_such_module_xyz:grade",
            r"--custom-rm-path 'no_such_module_xyz:grade': cannot import module 'no_such_module_xyz'",
        ),
        ("{mod}:missing", r"--custom-rm-path '{mod}:missing': module '{mod}' has no function 'missing'"),
        ("{mod}.missing", r"module '{mod}' has no function 'missing'"),
        ("{mod}:NOT_A_FUNCTION", r"--custom-rm-path .*not a function"),
        ("{mod}:async_grader", r"--custom-rm-path .*async"),
        ("justaname", r"--custom-rm-path 'justaname' must name a module and a function"),
        (":fn", r"--custom-rm-path ':fn' must name a module and a function"),
    ],
)
def test_bad_custom_paths_name_the_flag(custom_module, path, match):
    path, match = path.format(mod=custom_module), match.format(mod=custom_module)
    with pytest.raises(ValueError, match=match):
        RewardConfig(custom_rm_path=path).check_inputs()


def test_custom_path_wins_over_rm_type_and_runs_in_workers(custom_module):
    config = RewardConfig(rm_type="math", custom_rm_path=f"{custom_module}:exact", num_workers=1, timeout_s=20.0)
    with get_reward_fn(config) as reward_fn:
        rewards, counters = reward_fn(["7", " 7 ", "\\boxed{7}"], [7, "7", "7"])
    # `exact` compares stripped text: the boxed answer, right under `math`, is wrong here.
    assert rewards == [1.0, 1.0, 0.0]
    assert counters == {"graded": 3, "errors": 0, "timeouts": 0}


def exact_upper(response, label, **kwargs):
    return 1.0 if response.upper() == str(label).upper() else 0.0


def test_register_reward():
    register_reward("test_exact_upper")(exact_upper)
    register_reward("test_exact_upper")(exact_upper)  # re-registering the same function is harmless
    with pytest.raises(ValueError, match="already taken"):
        register_reward("test_exact_upper")(grade_math)
    with pytest.raises(ValueError, match="non-empty"):
        register_reward("")
    with get_reward_fn(RewardConfig(rm_type="test_exact_upper", num_workers=0)) as reward_fn:
        assert reward_fn(["abc", "abd"], ["ABC", "ABC"]) == ([1.0, 0.0], {"graded": 2, "errors": 0, "timeouts": 0})


def test_custom_path_finds_a_module_in_the_working_directory(tmp_path, monkeypatch):
    """`slime-sparse-train` (a console script) has no working directory on sys.path, unlike `python -m`."""
    (tmp_path / "my_cwd_reward.py").write_text("def score(response, label, **kwargs):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        config = RewardConfig(custom_rm_path="my_cwd_reward:score", num_workers=1, timeout_s=20.0)
        with get_reward_fn(config) as reward_fn:  # the worker processes find it too
            assert reward_fn(["x"], [None]) == ([0.5], {"graded": 1, "errors": 0, "timeouts": 0})
        assert sys.path[-1] == str(tmp_path)  # appended: an installed package of the same name would win
    finally:
        sys.modules.pop("my_cwd_reward", None)
    with pytest.raises(ValueError, match="cannot import module 'not_here_either'"):
        RewardConfig(custom_rm_path="not_here_either:score").check_inputs()
