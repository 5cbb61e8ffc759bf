"""--help of both commands: one group per config section, every flag a one-line help with its default, the help
text kept in one place (the config dataclasses' field metadata); eval's own usage and --output."""
import argparse
import re
import subprocess
import sys
from dataclasses import fields

import pytest

from slime_sparse.config import SECTION_TYPES, SECTIONS
from slime_sparse.config_loader import build_parser
from slime_sparse.eval.cli import build_eval_parser
from slime_sparse.flags import NO_FLAG, flag_for


def _groups(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    return {g.title: g._group_actions for g in parser._action_groups}


def test_train_help_groups_flags_by_section():
    groups = _groups(build_parser())
    assert list(groups)[2:] == list(SECTIONS)  # after argparse's positionals / options: train, rollout, ...
    for section in SECTIONS:
        in_group = {s for a in groups[section] for s in a.option_strings}
        for f in fields(SECTION_TYPES[section]):
            if f"{section}.{f.name}" not in NO_FLAG:
                assert flag_for(section, f.name) in in_group, (section, f.name)
    # slime's spellings and the flags taken at one value sit with what they set
    assert "--use-tis" in {s for a in groups["correction"] for s in a.option_strings}
    assert "--optimizer" in {s for a in groups["train"] for s in a.option_strings}
    assert "--context-parallel-size" in {s for a in groups["megatron"] for s in a.option_strings}


def test_every_flag_has_a_one_line_help_ending_with_its_default():
    parser = build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and "\n" not in action.help, action.option_strings
        assert "(default: " in action.help, action.option_strings
    helps = {s: a.help for a in parser._actions for s in a.option_strings}
    assert helps["--kv-budget"].endswith("(default: 512)")
    assert helps["--use-tensorboard"].endswith("(default: on)")
    assert helps["--disable-grpo-std-normalization"].endswith("(default: off)")
    assert helps["--rollout-stop-token-ids"].endswith("(default: unset)")
    assert helps["--rm-timeout"].startswith("wall-clock limit of one grader call")


def test_help_text_lives_only_in_field_metadata():
    """The help shown is the field's metadata help: the one source (no comment or docstring copy to drift)."""
    helps = {s: a.help for a in build_parser()._actions for s in a.option_strings}
    for section in SECTIONS:
        for f in fields(SECTION_TYPES[section]):
            if f"{section}.{f.name}" not in NO_FLAG:
                assert helps[flag_for(section, f.name)].startswith(f.metadata["help"]), (section, f.name)


def test_eval_help_is_evals_own_and_names_output():
    out = subprocess.run([sys.executable, "-m", "slime_sparse.eval", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: slime-sparse-eval")
    assert "--output PATH" in out.stdout and "usage: slime-sparse-train" not in out.stdout
    shown = set(re.findall(r"^  (--[a-z0-9-]+)", out.stdout, flags=re.M))
    for flag in ("--hf-checkpoint", "--eval-prompt-data", "--kv-budget", "--rollout-temperature", "--rm-type",
                 "--input-key", "--n-samples-per-eval-prompt", "--rollout-engine"):
        assert flag in shown, flag
    # the learner's, Megatron's, the correction's, the loop's: not evaluation's
    for flag in ("--lr", "--tensor-model-parallel-size", "--correction-preset", "--use-tis", "--save-interval",
                 "--num-rollout", "--optimizer", "--eps-clip", "--use-ray"):
        assert flag not in shown, flag
    assert len(out.stdout.splitlines()) < 0.5 * len(build_parser().format_help().splitlines())
    # yet a training command line parses: the hidden flags are accepted
    assert build_eval_parser().parse_args(["--lr", "1e-6", "--correction-preset", "mis"])
    eval_group = _groups(build_eval_parser())["eval"]
    assert "--output" in {s for a in eval_group for s in a.option_strings}


@pytest.fixture
def eval_args(tiny_assets):
    assets = tiny_assets()
    return ["--hf-checkpoint", str(assets.model_dir), "--eval-prompt-data", str(assets.test_path),
            "--custom-rm-path", "slime_sparse.tasks.repeated_add:task_reward", "--rm-num-workers", "0",
            "--rollout-max-response-len", "8"]


def test_eval_output_in_a_missing_directory_is_created(eval_args, tmp_path):
    from slime_sparse.eval.cli import main

    report = tmp_path / "new" / "deeper" / "report.json"
    assert main(eval_args + ["--output", str(report)]) == 0
    assert report.is_file()


def test_eval_output_that_cannot_be_written_fails_before_evaluating(eval_args, tmp_path, capsys, monkeypatch):
    import slime_sparse.factory

    def never(*_a, **_k):
        raise AssertionError("the engine was built: the evaluation started before --output was checked")

    monkeypatch.setattr(slime_sparse.factory, "build_engine", never)
    blocker = tmp_path / "file"
    blocker.write_text("")
    from slime_sparse.eval.cli import main

    assert main(eval_args + ["--output", str(blocker / "report.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --output") and "\n" not in err
