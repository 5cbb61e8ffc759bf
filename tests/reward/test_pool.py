"""Worker-process grading: timeouts, errors, crashes, threads (math-verify's SIGALRM), shutdown.

The graders below are module-level so that worker processes can import them by name (this test module is
importable by the workers because the pool passes on our sys.path).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from slime_sparse.reward import GraderPool, RewardConfig, get_reward_fn, register_reward
from slime_sparse.reward.math_verify_grader import grade_math_verify

SLEEP_S = 60.0  # far beyond every timeout below: a test that waited for it would be obvious


def scripted_grader(response: str, label, **kwargs) -> float:
    """Behaviour chosen by the response: sleep / raise / crash / non-number; else exact match."""
    if response == "sleep":
        time.sleep(SLEEP_S)
    if response == "raise":
        raise ValueError("grader bug")
    if response == "crash":
        os._exit(3)
    if response == "not a number":
        return "yes"  # type: ignore[return-value]
    if response == "pid":
        time.sleep(0.3)  # long enough that one worker cannot take the whole batch
        return float(os.getpid())
    if response == "bonus":
        return float(kwargs["bonus"])
    return 1.0 if response == label else 0.0


register_reward("test_scripted")(scripted_grader)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child that was reaped is gone; one not yet reaped would be a zombie (we reap in stop()).
    return True


@pytest.fixture(scope="module")
def pool():
    with GraderPool(scripted_grader, num_workers=2, timeout_s=1.0) as pool:
        pool.wait_until_ready()
        yield pool


def test_outcomes_in_order_across_both_workers(pool):
    tasks = [("pid", None, {})] * 6 + [("a", "a", {}), ("a", "b", {})]
    outcomes = pool.grade(tasks)
    assert [o.status for o in outcomes] == ["ok"] * 8
    pids = {o.reward for o in outcomes[:6]}
    assert pids == {float(pid) for pid in pool.worker_pids()}  # both workers graded part of the batch
    assert [o.reward for o in outcomes[6:]] == [1.0, 0.0]  # results stay aligned with their inputs


def test_timeout_scores_zero_kills_and_replaces_the_worker(pool):
    pids_before = set(pool.worker_pids())
    start = time.monotonic()
    outcomes = pool.grade([("a", "a", {}), ("sleep", "sleep", {}), ("b", "c", {})])
    elapsed = time.monotonic() - start
    assert [o.status for o in outcomes] == ["ok", "timeout", "ok"]
    assert [o.reward for o in outcomes] == [1.0, 0.0, 0.0]
    assert elapsed < SLEEP_S / 2  # the call was cut off, not waited for
    replaced = pids_before - set(pool.worker_pids())
    assert len(replaced) == 1 and not _alive(replaced.pop())
    # The replacement serves the next batch.
    assert [o.reward for o in pool.grade([("x", "x", {})] * 3)] == [1.0] * 3


def test_raise_non_number_and_crash_are_errors(pool):
    outcomes = pool.grade([("raise", None, {}), ("not a number", None, {}), ("crash", None, {}), ("z", "z", {})])
    assert [o.status for o in outcomes] == ["error", "error", "error", "ok"]
    assert [o.reward for o in outcomes] == [0.0, 0.0, 0.0, 1.0]
    assert "ValueError: grader bug" in outcomes[0].message
    assert "TypeError" in outcomes[1].message
    assert "exit code 3" in outcomes[2].message
    assert pool.grade([("q", "q", {})])[0].reward == 1.0  # the crashed worker was replaced


def test_unpicklable_label_is_an_error_not_a_crash(pool):
    outcomes = pool.grade([("a", threading.Lock(), {}), ("a", "a", {})])
    assert [o.status for o in outcomes] == ["error", "ok"]


def test_reward_fn_counters_and_stats():
    config = RewardConfig(rm_type="test_scripted", timeout_s=1.0, num_workers=2)
    with get_reward_fn(config) as reward_fn:
        rewards, counters = reward_fn(
            ["a", "raise", "sleep", "b", "bonus"],
            ["a", None, None, "c", None],
            extras=[{}, {}, {}, {}, {"bonus": 0.25}],
        )
        assert rewards == [1.0, 0.0, 0.0, 0.0, 0.25]
        assert counters == {"graded": 3, "errors": 1, "timeouts": 1}
        _, counters = reward_fn(["a"], ["a"])
        assert counters == {"graded": 1, "errors": 0, "timeouts": 0}
        assert reward_fn.stats.as_dict() == {"graded": 4, "errors": 1, "timeouts": 1}  # accumulated
        with pytest.raises(ValueError, match="2 responses but 1 labels"):
            reward_fn(["a", "b"], ["a"])


def test_inline_mode_counts_errors_without_processes():
    with get_reward_fn(RewardConfig(rm_type="test_scripted", num_workers=0, max_error_rate=1.0)) as reward_fn:
        rewards, counters = reward_fn(["a", "raise", "not a number"], ["a", None, None])
    assert rewards == [1.0, 0.0, 0.0]
    assert counters == {"graded": 1, "errors": 2, "timeouts": 0}


def test_close_stops_workers_and_is_idempotent():
    pool = GraderPool(scripted_grader, num_workers=2, timeout_s=2.0)
    pids = pool.worker_pids()
    assert all(_alive(pid) for pid in pids)
    pool.close()
    pool.close()
    assert pool.closed and not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="after close"):
        pool.grade([("a", "a", {})])


def test_reward_fn_context_manager_closes_pool():
    with get_reward_fn(RewardConfig(rm_type="test_scripted", num_workers=1)) as reward_fn:
        pids = reward_fn._pool.worker_pids()
    assert not any(_alive(pid) for pid in pids)


def test_graders_must_be_importable_by_workers():
    with pytest.raises(ValueError, match="module-level"):
        GraderPool(lambda response, label: 1.0, num_workers=1, timeout_s=1.0)

    def nested(response, label):
        return 1.0

    with pytest.raises(ValueError, match="module-level"):
        GraderPool(nested, num_workers=1, timeout_s=1.0)


def test_worker_that_cannot_import_its_grader_fails_loudly(tmp_path, monkeypatch):
    # Importable here, but its import raises inside a worker (whose argv[0] is worker.py).
    (tmp_path / "only_in_parent.py").write_text(
        "import sys\n"
        "if sys.argv[0].endswith('worker.py'):\n"
        "    raise RuntimeError('not importable in workers')\n"
        "def grade(response, label, **kwargs):\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_in_parent

    try:
        with GraderPool(only_in_parent.grade, num_workers=1, timeout_s=1.0) as broken:
            with pytest.raises(RuntimeError, match="cannot load grader only_in_parent:grade.*not importable"):
                broken.wait_until_ready()
    finally:
        sys.modules.pop("only_in_parent", None)


# ---------------------------------------------------------------------------------------------------
# math-verify off the main thread (its own timeouts use SIGALRM)
# ---------------------------------------------------------------------------------------------------

MV_RESPONSES = ["so \\boxed{0.5}", "\\boxed{2(x+1)}", "\\boxed{3}", "\\boxed{[4, \\infty)}"]
MV_LABELS = ["\\frac{1}{2}", "2x+2", "4", "[4,\\infty)"]
MV_EXPECTED = [1.0, 1.0, 0.0, 1.0]


def _run_in_thread(fn):
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below on the test thread
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_math_verify_defaults_fail_off_the_main_thread():
    # Control: why the grader disables math-verify's timeouts. If this stops raising, math-verify changed.
    from math_verify import parse

    with pytest.raises(ValueError, match="thread"):
        _run_in_thread(lambda: parse("\\boxed{1}"))


def test_math_verify_grader_works_off_the_main_thread():
    rewards = _run_in_thread(
        lambda: [grade_math_verify(r, lab) for r, lab in zip(MV_RESPONSES, MV_LABELS, strict=True)]
    )
    assert rewards == MV_EXPECTED


def test_math_verify_reward_fn_called_from_a_thread():
    with get_reward_fn(RewardConfig(rm_type="math_verify", num_workers=1, timeout_s=20.0)) as reward_fn:
        rewards, counters = _run_in_thread(lambda: reward_fn(MV_RESPONSES, MV_LABELS))
    assert rewards == MV_EXPECTED
    assert counters == {"graded": 4, "errors": 0, "timeouts": 0}


def test_math_reward_fn_through_workers():
    with get_reward_fn(RewardConfig(rm_type="math", num_workers=1, timeout_s=20.0)) as reward_fn:
        rewards, counters = reward_fn(["\\boxed{\\dfrac12}", "\\boxed{10^{\\circ}}", "no box 5"], ["0.5", "10", "5"])
    assert rewards == [1.0, 1.0, 0.0]
    assert counters == {"graded": 3, "errors": 0, "timeouts": 0}


_initialised = False


def _initialise() -> None:
    """A grader's one-off start-up cost (math-verify: its imports and LaTeX grammar, seconds on a busy machine)."""
    global _initialised
    time.sleep(2.0)
    _initialised = True


def lazily_initialised(response: str, label, **kwargs) -> float:
    if not _initialised:
        _initialise()
    return 1.0 if response == label else 0.0


lazily_initialised.warm_up = _initialise


def test_warm_up_runs_before_ready_not_inside_a_call_timeout():
    """After a timeout, the next answer goes to a fresh worker: its start-up must not time that answer out too."""
    with GraderPool(lazily_initialised, num_workers=1, timeout_s=1.0) as lazy:
        outcomes = lazy.grade([("a", "a", {}), ("b", "c", {})])
        assert [o.status for o in outcomes] == ["ok", "ok"]
        lazy._replace(0)  # as after a timeout: a fresh worker, not yet initialised
        assert [o.reward for o in lazy.grade([("x", "x", {})])] == [1.0]


def test_math_verify_warms_up_in_its_worker():
    """Its warm-up runs in a worker (an error there would fail the pool's start-up) and leaves it grading."""
    with GraderPool(grade_math_verify, num_workers=1, timeout_s=20.0) as mv:
        mv.wait_until_ready()
        (outcome,) = mv.grade([("\\boxed{\\frac{1}{2}}", "0.5", {})])
    assert outcome.status == "ok" and outcome.reward == 1.0


def hog_memory(response: str, label, **kwargs) -> float:
    """Builds a ~1 GB string, as sympy does with an answer like 10^(10^9)."""
    return float(len("x" * (1 << 30)))


def test_memory_blowup_is_an_error_under_the_cap():
    with GraderPool(hog_memory, num_workers=1, timeout_s=20.0, memory_limit_mb=256) as capped:
        (outcome,) = capped.grade([("a", "a", {})])
    assert outcome.status == "error" and "MemoryError" in outcome.message


def raise_by_kind(response: str, label, **kwargs) -> float:
    if response == "value":
        raise ValueError("bad label format")
    if response == "key":
        raise KeyError("missing")
    return 1.0


def test_raising_grader_is_reported_once_with_traceback_and_counted(caplog):
    config = RewardConfig(custom_rm_path=f"{__name__}:raise_by_kind", num_workers=1, timeout_s=20.0,
                          max_error_rate=1.0)  # counted, not stopped (tests/reward/test_failures.py)
    with caplog.at_level("WARNING", logger="slime_sparse.reward.reward_fn"), get_reward_fn(config) as reward_fn:
        for _ in range(3):
            rewards, counters = reward_fn(["value", "ok", "value"], [None, None, None])
            assert rewards == [0.0, 1.0, 0.0] and counters == {"graded": 1, "errors": 2, "timeouts": 0}
        reward_fn(["key"], [None])
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) == 2  # one per kind of failure, not one per batch or per response
    assert "ValueError: bad label format" in reports[0] and "Traceback (most recent call last)" in reports[0]
    assert 'raise ValueError("bad label format")' in reports[0]  # the grader's own line
    assert "KeyError" in reports[1]
    assert reward_fn.stats.as_dict() == {"graded": 3, "errors": 7, "timeouts": 0}


def test_inline_grader_failure_is_reported_with_traceback(caplog):
    config = RewardConfig(custom_rm_path=f"{__name__}:raise_by_kind", num_workers=0, max_error_rate=1.0)
    with caplog.at_level("WARNING", logger="slime_sparse.reward.reward_fn"), get_reward_fn(config) as reward_fn:
        assert reward_fn(["value", "value"], [None, None]) == ([0.0, 0.0], {"graded": 0, "errors": 2, "timeouts": 0})
    (report,) = [r.getMessage() for r in caplog.records]
    assert "Traceback" in report and "bad label format" in report


PARENT = """
import sys, time, threading
from slime_sparse.reward import GraderPool
sys.path.insert(0, {tests!r})
from test_pool import scripted_grader
pool = GraderPool(scripted_grader, num_workers=2, timeout_s=600.0)
pool.wait_until_ready()
print(" ".join(map(str, pool.worker_pids())), flush=True)
pool.grade([("sleep", None, {{}}), ("a", "a", {{}})])  # one worker hangs in its grader
"""


def test_workers_do_not_outlive_a_killed_trainer(tmp_path):
    import signal
    import subprocess

    tests = os.path.dirname(os.path.abspath(__file__))
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(tests=tests)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    time.sleep(1.0)  # the busy worker is inside its 60 s sleep, the idle one waits for work
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10.0
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)
