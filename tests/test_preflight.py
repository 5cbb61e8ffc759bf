"""Warnings before a run that cannot learn or cannot compress: one stderr line each, `warning:` first, naming the
flag to change; the no-gradient warning once per run, with the fraction of flat groups in metrics.jsonl."""
import dataclasses

import pytest

from slime_sparse.config import RunConfig
from slime_sparse.kv.config import KVCompressConfig
from slime_sparse.kv.schedule import never_compresses
from slime_sparse.preflight import no_gradient_warning, start_warnings
from slime_sparse.rollout.sampling import SamplingParams
from tests.helpers.tiny_runs import read_metrics, run_args


def _cfg(method="rkv", budget=16, buffer=4, max_new=24, temperature=1.0, n=4) -> RunConfig:
    cfg = RunConfig()
    return dataclasses.replace(
        cfg, kv=KVCompressConfig(method=method, budget=budget, buffer=buffer),
        sampling=SamplingParams(max_new_tokens=max_new, temperature=temperature),
        rollout=dataclasses.replace(cfg.rollout, n_samples_per_prompt=n))


@pytest.mark.parametrize("method,budget,buffer,prompt,max_new,never", [
    ("rkv", 16, 4, 10, 24, False),    # 20 < 34: compresses
    ("rkv", 24, 10, 10, 24, True),    # 34 >= 34: the trigger is never reached
    ("rkv", 512, 128, 40, 64, True),  # the default budget on a short task
    ("none", 8, 4, 40, 64, False),    # dense on purpose: nothing to warn about
    ("snapkv", 32, 64, 40, 24, False),  # the prompt is cut to the budget once prefilled
    ("snapkv", 64, 64, 40, 24, True),
])
def test_never_compresses(method, budget, buffer, prompt, max_new, never):
    assert never_compresses(KVCompressConfig(method=method, budget=budget, buffer=buffer), prompt, max_new) is never


def test_start_warnings_name_the_flag_to_change():
    assert start_warnings(_cfg(), longest_prompt=10) == []
    (kv,) = start_warnings(_cfg(budget=512, buffer=128), longest_prompt=10)
    assert kv.startswith("--kv-budget 512 + --kv-buffer 128 = 640") and "--kv-method rkv never compresses" in kv
    assert "the longest prompt, 10 tokens" in kv and kv.endswith("make --kv-budget + --kv-buffer less than 34")
    (greedy,) = start_warnings(_cfg(temperature=0.0), longest_prompt=10)
    assert greedy.startswith("--rollout-temperature 0 with --n-samples-per-prompt 4")
    assert start_warnings(_cfg(temperature=0.0, n=1), longest_prompt=10) == []  # one sample: nothing identical


def test_no_gradient_warning_only_when_every_group_is_flat():
    assert no_gradient_warning(3, {"adv/zero_std_frac": 0.75}) is None
    assert no_gradient_warning(3, {}) is None
    line = no_gradient_warning(3, {"adv/zero_std_frac": 1.0})
    assert line.startswith("rollout 3:") and "adv/zero_std_frac" in line and "--custom-rm-path" in line


def test_a_run_that_cannot_learn_or_compress_says_so_on_stderr(tiny_assets, tmp_path, capsys, monkeypatch):
    (tmp_path / "flat_reward.py").write_text("def zero(response, label, **kwargs):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from slime_sparse.train import main

    run = tmp_path / "run"
    argv = run_args(tiny_assets(), run, 2, "--custom-rm-path", "flat_reward:zero", "--kv-budget", "512",
                    "--rollout-temperature", "0")
    assert main(argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert [w.split()[1] for w in warnings] == ["--kv-budget", "--rollout-temperature", "rollout"], warnings
    assert warnings[2].startswith("warning: rollout 1: every group's rewards were equal")  # once, not per rollout
    rows = [r for r in read_metrics(run) if "rollout/reward_mean" in r]
    assert [r["adv/zero_std_frac"] for r in rows] == [1.0, 1.0]
