"""Reward failures are never silent: counted per rollout (metrics.jsonl and the progress line), a batch with more
than --rm-max-error-rate failures stops the run with the first traceback, --rm-num-workers 0 honours
--rm-timeout. (Graders outliving a kill -9 of the trainer: tests/reward/test_pool.py.)"""
import itertools
import threading
import time

import pytest

from slime_sparse.reward import RewardConfig, RewardFailure, get_reward_fn
from tests.reward.test_pool import SLEEP_S  # noqa: F401 - registers the "test_scripted" grader
from tests.helpers.tiny_runs import rollout_rows, run_args


def spin(response: str, label, **kwargs) -> float:
    while True:  # a grader that never returns (pure Python: SIGALRM reaches it)
        pass


def inline(**kw):
    return get_reward_fn(RewardConfig(num_workers=0, **kw))


def test_inline_grading_honours_the_timeout():
    with inline(rm_type="test_scripted", timeout_s=0.5, max_error_rate=1.0) as reward_fn:
        t0 = time.monotonic()
        rewards, counters = reward_fn(["sleep", "a", "b"], ["x", "a", "a"])
        assert time.monotonic() - t0 < SLEEP_S / 4
    assert rewards == [0.0, 1.0, 0.0] and counters == {"graded": 2, "errors": 0, "timeouts": 1}


def test_an_inline_grader_that_never_returns_never_hangs_the_run():
    with inline(custom_rm_path="tests.reward.test_failures:spin", timeout_s=0.3, max_error_rate=1.0) as reward_fn:
        assert reward_fn(["a", "b"], ["a", "b"])[1] == {"graded": 0, "errors": 0, "timeouts": 2}


def test_inline_grading_off_the_main_thread_is_refused():
    caught = []
    with inline(rm_type="test_scripted") as reward_fn:
        thread = threading.Thread(target=lambda: caught.append(_raises(lambda: reward_fn(["a"], ["a"]))))
        thread.start()
        thread.join(30)
    assert "--rm-num-workers >= 1" in str(caught[0])


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


@pytest.mark.parametrize("workers", [0, 1])
def test_more_failures_than_the_max_error_rate_stop_with_the_first_traceback(workers):
    with get_reward_fn(RewardConfig(rm_type="test_scripted", num_workers=workers, timeout_s=5.0)) as reward_fn:
        # half of the batch failing is within the default 0.5
        assert reward_fn(["raise", "not a number", "a", "a"], ["a"] * 4)[1]["errors"] == 2
        with pytest.raises(RewardFailure) as err:
            reward_fn(["raise", "raise", "not a number", "a"], ["a"] * 4)
    message = str(err.value)
    assert message.startswith("reward: 3 of 4 rewards of this batch failed (3 errors, 0 timeouts), more than "
                              "--rm-max-error-rate 0.5")
    assert "Traceback (most recent call last)" in message and "ValueError: grader bug" in message


def test_max_error_rate_one_never_stops():
    with inline(rm_type="test_scripted", max_error_rate=1.0) as reward_fn:
        assert reward_fn(["raise"] * 3, ["a"] * 3)[1]["errors"] == 3


_calls = itertools.count()


def every_fourth_raises(response: str, label, **kwargs) -> float:
    if next(_calls) % 4 == 3:
        raise RuntimeError("flaky grader")
    return 0.0


def always_raises(response: str, label, **kwargs) -> float:
    raise RuntimeError("broken grader")


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=64)


def test_failures_are_counted_per_rollout_in_metrics_and_progress(assets, tmp_path, caplog):
    import logging

    from slime_sparse.train import main

    run = tmp_path / "run"
    argv = run_args(assets, run, 2, "--custom-rm-path", "tests.reward.test_failures:every_fourth_raises", "--progress-bar")
    with caplog.at_level(logging.INFO, logger="slime_sparse.progress"):  # the progress line off a terminal
        assert main(argv) == 0
    assert [r["reward/errors"] for r in rollout_rows(run)] == [2.0, 2.0]  # 8 samples a rollout, every 4th fails
    progress = [r.getMessage() for r in caplog.records if r.name == "slime_sparse.progress"]
    assert progress and "rm_fail=2" in progress[-1], progress


def test_a_broken_grader_stops_the_run_with_its_traceback(assets, tmp_path, capsys):
    from slime_sparse.train import main

    argv = run_args(assets, tmp_path / "run", 2, "--custom-rm-path", "tests.reward.test_failures:always_raises")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: reward: 8 of 8 rewards of this batch failed (8 errors, 0 timeouts)" in err
    assert "RuntimeError: broken grader" in err and 'in always_raises\n    raise RuntimeError("broken grader")' in err
