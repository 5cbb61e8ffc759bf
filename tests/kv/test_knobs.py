"""A KV method class is its own config: each knob is declared once, as a field of its method class
(slime_sparse/kv/methods/), and from that declaration alone it is a field of KVCompressConfig, a `--kv-*` flag with
its help and default, a YAML key of section `kv` and a knob the presets set (kv/config.py `with_method_knobs`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from slime_sparse.config_loader import build_parser, load_config
from slime_sparse.kv.config import KVCompressConfig, with_method_knobs
from slime_sparse.kv.methods import REGISTRY, KVMethod, knob

# The flags and YAML keys users type today (slime-compatible names): they must not change.
KV_FLAGS = ("--kv-method", "--kv-budget", "--kv-buffer", "--kv-n-sink", "--kv-granularity", "--kv-budget-schedule",
            "--kv-layer-budgets", "--kv-preset", "--kv-window", "--kv-kernel-size", "--kv-pooling",
            "--kv-gqa-reduce", "--kv-mix-lambda", "--kv-sim-threshold", "--kv-pyramid-beta")
KNOBS = ("window", "kernel_size", "pooling", "gqa_reduce", "mix_lambda", "sim_threshold", "pyramid_beta")


def kv_actions() -> dict[str, object]:
    return {a.option_strings[0]: a for a in build_parser()._actions
            if a.option_strings and a.dest.startswith("kv.")}


def test_the_kv_flags_are_the_ones_users_type():
    assert sorted(kv_actions()) == sorted(KV_FLAGS)
    assert KVCompressConfig.PRESET_FIELDS == KNOBS


def test_every_method_knob_is_a_config_field_flag_and_help_line_from_its_one_declaration():
    fields = {f.name: f for f in dataclasses.fields(KVCompressConfig)}
    actions = kv_actions()
    seen = set()
    for method in REGISTRY.values():
        for f in method.knobs():
            seen.add(f.name)
            assert fields[f.name].default == f.default
            assert fields[f.name].metadata["help"] == f.metadata["help"]
            help_line = actions["--kv-" + f.name.replace("_", "-")].help
            assert help_line == f"{f.metadata['help']} (default: {f.default})"
    assert seen == set(KNOBS)


def test_method_knobs_set_by_flag_and_yaml_reach_the_method(tmp_path, tiny_assets):
    assets = tiny_assets()
    base = ["--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path)]
    y = tmp_path / "run.yaml"
    y.write_text("kv: {method: rkv, budget: 64, mix_lambda: 0.3, kernel_size: 5}\n")
    cfg = load_config(base + ["--config", str(y), "--kv-sim-threshold", "0.7", "--kv-pooling", "avg"]).kv
    scorer = cfg.scorer
    assert (scorer.mix_lambda, scorer.kernel_size, scorer.sim_threshold, scorer.pooling) == (0.3, 5, 0.7, "avg")
    with pytest.raises(ValueError, match="--kv-mix-lambda=1.5 is invalid"):
        load_config(base + ["--kv-method", "rkv", "--kv-budget", "64", "--kv-mix-lambda", "1.5"])


def test_a_new_methods_knob_becomes_a_field_and_a_preset_knob(monkeypatch):
    @dataclass(frozen=True)
    class Probe(KVMethod):
        name = "probe"
        probe_depth: int = knob(3, "the probe's depth")

    monkeypatch.setitem(REGISTRY, "probe", Probe)

    @dataclass(frozen=True)
    @with_method_knobs
    class Config:
        method: str = "none"

    names = [f.name for f in dataclasses.fields(Config)]
    assert names[0] == "method" and names[-1] == "probe_depth" and "window" in names
    assert Config().probe_depth == 3 and Config.PRESET_FIELDS[-1] == "probe_depth"
    assert dataclasses.fields(Config)[-1].metadata["help"] == "the probe's depth"


def test_a_knob_declared_twice_is_refused(monkeypatch):
    @dataclass(frozen=True)
    class Clash(KVMethod):
        name = "clash"
        kernel_size: int = knob(9, "another kernel")  # the same name as SnapKV's, another default

    monkeypatch.setitem(REGISTRY, "clash", Clash)
    with pytest.raises(TypeError, match="knob 'kernel_size' differs"):
        with_method_knobs(type("Config", (), {"__annotations__": {}}))
    monkeypatch.delitem(REGISTRY, "clash")

    class OnTheConfig:  # the config re-declaring a method's knob
        __annotations__ = {"window": int}
        window: int = field(default=4)

    with pytest.raises(TypeError, match="declare it on the method only"):
        with_method_knobs(OnTheConfig)
