"""Errors that name the fix (#45): a mistyped --kv-method lists the methods, a negative number is a flag's value,
and a malformed data row is the only line a failed start prints."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_sparse.config_loader import parse_config
from slime_sparse.kv.config import METHODS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags", [["--kv-method", "rkvv"], ["--kv-method", "rkvv", "--kv-preset", "kvpress"],
                                   ["--kv-preset", "rkv-code", "--kv-method", "snap"]])
def test_an_unknown_kv_method_lists_the_methods(flags):
    with pytest.raises(ValueError) as err:
        parse_config(flags)
    method = flags[flags.index("--kv-method") + 1]
    assert str(err.value) == f"--kv-method={method!r} is invalid: choose one of {METHODS}"


def test_a_known_method_the_preset_lacks_still_names_the_preset():
    with pytest.raises(ValueError, match=r"--kv-preset='rkv-code' is invalid: has no settings for --kv-method="):
        parse_config(["--kv-preset", "rkv-code", "--kv-method", "keydiff"])


@pytest.mark.parametrize("value", ["-1e-5", "-.5", "-3", "-2.5E-3"])
def test_a_negative_number_after_a_flag_is_its_value(value):
    with pytest.raises(ValueError) as err:  # parsed: the range check speaks, not argparse
        parse_config(["--lr", value])
    assert str(err.value) == f"--lr={float(value)!r} is invalid: must be > 0"



def test_a_valid_negative_value_is_taken():
    cfg, _ = parse_config(["--rollout-top-k", "-1", "--eval-top-k", "-1"])
    assert cfg.sampling.top_k == -1 and cfg.eval.eval_top_k == -1


def test_eval_takes_a_negative_number_after_a_flag_too(capsys):
    from slime_sparse.eval.cli import main

    assert main(["--lr", "-1e-5", "--output", "x.json"]) == 2
    assert capsys.readouterr().err.strip() == "error: --lr=-1e-05 is invalid: must be > 0"


def test_a_word_that_is_not_a_number_is_still_a_flag():
    with pytest.raises(SystemExit):  # argparse: --lr expected one argument
        parse_config(["--lr", "--seed", "1"])


def bad_data(assets, tmp_path, row: str) -> Path:
    """The tiny training data with `row` as data row 20 (line 21)."""
    lines = Path(assets.train_path).read_text().splitlines()
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines[:20] + [row] + lines[20:40]) + "\n")
    return data


def train_flags(assets, data, run_dir) -> list[str]:
    return ["--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(data), "--run-dir", str(run_dir),
            "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--rm-num-workers", "0",
            "--custom-rm-path", "slime_sparse.tasks.repeated_add:task_reward"]


def test_a_malformed_row_prints_one_line_and_nothing_else(tiny_assets, tmp_path):
    """The issue's case, in a fresh process (so `datasets`' own prints and logs would show): a label that changes
    type, which pyarrow rejects. The start-up banner comes only after the checks, and neither `datasets` nor
    pyarrow adds a line."""
    assets = tiny_assets()
    data = bad_data(assets, tmp_path, '{"prompt": "1+2=", "label": {"x": 1}}')
    proc = subprocess.run([sys.executable, "-m", "slime_sparse.train", *train_flags(assets, data, tmp_path / "run")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), HF_DATASETS_CACHE=str(tmp_path / "hf")))
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"error: --prompt-data {data}: row 20 (0-based), line 21: 'label' holds an object but "
                           "row 0 holds a string; a column must hold one JSON type (this row cannot be skipped, fix "
                           "it)\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("row,why", [("not json", "not valid JSON"), ('{"prompt": "1+2="}', "--label-key 'label' is "
                                                                                           "missing or null")])
def test_other_malformed_rows_print_one_line_too(tiny_assets, tmp_path, capfd, row, why):
    from slime_sparse.train import main

    assets = tiny_assets()
    data = bad_data(assets, tmp_path, row)
    assert main(train_flags(assets, data, tmp_path / "run")) == 2
    out, err = capfd.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: --prompt-data {data}: row 20 (0-based), line 21: {why}")
    assert not (tmp_path / "run").exists()
