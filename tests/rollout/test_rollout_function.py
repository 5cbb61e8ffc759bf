"""--rollout-function-path: a function with slime's signature fn(args, rollout_id, data_source, evaluation=False)
replaces the default rollout function, in its RolloutFnTrainOutput form or slime's older bare list of groups."""
import pytest

from slime_sparse.train import main
from tests.helpers.tiny_runs import comparable, rollout_rows
from tests.helpers.tiny_runs import run_args as args


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=64)


@pytest.fixture(scope="module")
def default_run(assets, tmp_path_factory):
    run = tmp_path_factory.mktemp("default") / "run"
    assert main(args(assets, run, 2)) == 0
    return rollout_rows(run)


def test_a_function_given_by_path_replaces_the_default(assets, tmp_path, default_run):
    run = tmp_path / "run"
    assert main(args(assets, run, 2, "--rollout-function-path", "tests.helpers.tiny_runs.first_group_only")) == 0
    rows = rollout_rows(run)
    # its own metric, and the batch it returned: one group of 4 samples where the default trains on 2 groups
    assert [r["custom/rollout_id"] for r in rows] == [0.0, 1.0]
    assert [r["correction/seqs"] for r in rows] == [4.0, 4.0]
    assert [r["correction/seqs"] for r in default_run] == [8.0, 8.0]
    assert "rollout/groups_generated" not in rows[0]  # the default's metrics are not logged: it returned none


def test_slimes_older_form_trains_on_the_same_groups_as_the_default(assets, tmp_path, default_run):
    """The bare list of groups: the loop recomputes pi_old and the response metrics itself, so the run equals the
    default's in every metric both log."""
    run = tmp_path / "run"
    assert main(args(assets, run, 2, "--rollout-function-path", "tests.helpers.tiny_runs:groups_only")) == 0
    rows = rollout_rows(run)
    assert "rollout/groups_generated" not in rows[0] and "rollout/groups_generated" in default_run[0]
    for mine, default in zip(rows, default_run, strict=True):
        shared = comparable(mine).keys() & comparable(default).keys()
        assert {k: mine[k] for k in shared} == {k: default[k] for k in shared}
        assert {"rollout/reward_mean", "correction/seq_reject_rate", "train/loss", "mismatch/k3"} <= shared


def test_a_path_that_does_not_import_is_one_line_naming_the_flag(assets, tmp_path, capsys):
    assert main(args(assets, tmp_path / "run", 1, "--rollout-function-path",
                     "tests.helpers.tiny_runs.no_such_function")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --rollout-function-path 'tests.helpers.tiny_runs.no_such_function'") and "\n" not in err
    assert not (tmp_path / "run").exists()
