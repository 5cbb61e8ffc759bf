"""slime-sparse-eval prints the report it writes: one JSON document, each set's report under a named key (#45: a bare
path was printed under "" and without its `kv` block)."""
from __future__ import annotations

import json

import pytest


@pytest.fixture
def eval_args(tiny_assets):
    assets = tiny_assets()
    return assets, ["--hf-checkpoint", str(assets.model_dir), "--custom-rm-path",
                    "slime_sparse.tasks.repeated_add:task_reward", "--rm-num-workers", "0",
                    "--rollout-max-response-len", "8", "--kv-method", "rkv", "--kv-budget", "4", "--kv-buffer", "2",
                    "--kv-window", "2"]


def test_one_bare_path_is_keyed_by_its_file_name_and_printed_as_written(eval_args, tmp_path, capsys):
    from slime_sparse.eval.cli import main

    assets, flags = eval_args
    out = tmp_path / "report.json"
    assert main(flags + ["--eval-prompt-data", str(assets.test_path), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    written = out.read_text()
    assert printed == written  # the same document, character for character
    report = json.loads(written)
    name = assets.test_path.stem
    assert list(report) == [name] and "" not in report
    assert report[name]["kv"]["method"] == "rkv" and report[name]["kv"]["budget"] == 4
    assert report[name]["data"] == str(assets.test_path) and 0.0 <= report[name]["pass@1"] <= 1.0


def test_named_sets_keep_their_names(eval_args, tmp_path, capsys):
    from slime_sparse.eval.cli import main

    assets, flags = eval_args
    out = tmp_path / "report.json"
    assert main(flags + ["--eval-prompt-data", "first", str(assets.test_path), "second", str(assets.test_path),
                         "--output", str(out)]) == 0
    assert capsys.readouterr().out == out.read_text()
    report = json.loads(out.read_text())
    assert list(report) == ["first", "second"] and all("kv" in r for r in report.values())
    assert report["first"]["pass@1"] == report["second"]["pass@1"]  # greedy: the same set, the same answers
