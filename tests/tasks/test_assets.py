"""The task assets (slime_sparse/tasks/assets.py): build, cache key, resume, bad configs, the default build end to end."""
from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from slime_sparse.tasks.assets import AssetsConfig, build_assets, load_rows
from slime_sparse.tasks.evaluate import generate
from slime_sparse.tasks.repeated_add import RepeatedAddConfig, task_reward
from slime_sparse.tasks.tiny_model import TinyModelConfig
from slime_sparse.tasks.warm_start import WarmStartConfig
from tests.tasks.common import MICRO_MODEL, raise_after


def _micro_assets(**overrides) -> AssetsConfig:
    base = dict(
        task=RepeatedAddConfig(min_count=1, max_count=3),
        model=MICRO_MODEL,
        warm_start=WarmStartConfig(steps=2, batch_size=4),
        n_train=40,
        n_test=8,
    )
    base.update(overrides)
    return AssetsConfig(**base)


def test_assets_build_then_cache_hit(tmp_path):
    config = _micro_assets()
    first = build_assets(tmp_path, config, log=None)
    assert not first.cache_hit
    for path in (first.train_path, first.test_path, first.metadata_path, first.tokenizer_dir / "tokenizer.json"):
        assert path.is_file()
    for model_dir in (first.init_model_dir, first.model_dir):
        assert (model_dir / "model.safetensors").is_file() and (model_dir / "config.json").is_file()
    train, test = load_rows(first, "train"), load_rows(first, "test")
    assert len(train) == 40 and len(test) == 8
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    meta = first.metadata()
    assert meta["key"] == config.key() and meta["warm_start"]["steps"] == 2

    # The warm-started model differs from the initial one and reloads with from_pretrained.
    init = Qwen2ForCausalLM.from_pretrained(str(first.init_model_dir))
    warm = Qwen2ForCausalLM.from_pretrained(str(first.model_dir))
    assert not all(torch.equal(p, q) for p, q in zip(init.parameters(), warm.parameters()))
    assert AutoTokenizer.from_pretrained(str(first.model_dir))("12=")["input_ids"] == [1, 5, 6, 18]

    mtime = first.model_dir.joinpath("model.safetensors").stat().st_mtime_ns
    second = build_assets(tmp_path, config, log=None)
    assert second.cache_hit and second.root == first.root
    assert second.model_dir.joinpath("model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.root.name]  # no staging leftovers


def test_assets_key_depends_on_every_parameter(tmp_path):
    base = _micro_assets()
    variants = [
        _micro_assets(n_train=41),
        _micro_assets(seed=1),
        _micro_assets(task=RepeatedAddConfig(min_count=1, max_count=4)),
        _micro_assets(model=TinyModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=64)),
        _micro_assets(warm_start=WarmStartConfig(steps=3, batch_size=4)),
        _micro_assets(warm_start=None),
    ]
    keys = {base.key()} | {v.key() for v in variants}
    assert len(keys) == 1 + len(variants)
    assert base.key() == _micro_assets().key()
    # the warm start's threads change its float sums, hence the assets
    assert _micro_assets(warm_start=WarmStartConfig(steps=2, batch_size=4, threads=None)).key() != base.key()
    other = build_assets(tmp_path, _micro_assets(warm_start=None), log=None)
    assert not other.cache_hit and other.root.name.endswith(_micro_assets(warm_start=None).key())
    assert other.metadata()["warm_start"] is None


def test_assets_reject_bad_config(tmp_path):
    with pytest.raises(ValueError, match="n_train"):
        build_assets(tmp_path, _micro_assets(n_train=0), log=None)
    with pytest.raises(ValueError, match="distinct"):  # 90 * 8 * 3 problems in the micro task ranges
        build_assets(tmp_path, _micro_assets(n_train=2000, n_test=200), log=None)
    assert not any(tmp_path.iterdir())




def test_an_interrupted_asset_build_resumes(tmp_path, monkeypatch):
    ws = sys.modules["slime_sparse.tasks.warm_start"]  # the package exports a function of the same name

    config = _micro_assets(warm_start=WarmStartConfig(steps=8, batch_size=4))
    reference = build_assets(tmp_path / "a", config, log=None, progress=False)
    real = ws._train

    def interrupted(*args):
        args = list(args)
        args[6] = 2  # checkpoint_every
        monkeypatch.setattr(ws, "length_groups", raise_after(ws.length_groups, 5))  # stops in step 6
        return real(*args)

    monkeypatch.setattr(ws, "_train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_assets(tmp_path / "b", config, log=None, progress=False)
    monkeypatch.undo()
    partial = tmp_path / "b" / f".repeated_add-{config.key()}.partial"
    assert (partial / "warm_start.ckpt").is_file() and not (tmp_path / "b" / reference.root.name).exists()
    resumed = build_assets(tmp_path / "b", config, log=None, progress=False)
    assert not resumed.cache_hit and not partial.exists()
    assert not (resumed.root / "warm_start.ckpt").exists()
    weights = "model.safetensors"
    assert (resumed.model_dir / weights).read_bytes() == (reference.model_dir / weights).read_bytes()



# ---------------------------------------------------------------- the default assets, end to end


@pytest.mark.slow
def test_default_assets_land_in_the_rl_sweet_spot(tmp_path):
    """The default build (~1.5-2 min of CPU, one thread) answers bare (a guess) for most prompts under greedy
    decoding while its scratchpad is mostly right: GRPO has something to learn. The scratchpad survives a
    cache of the prompt + a recent window, not one of 2 sinks + the last 8 tokens.

    The recent window is 20, the main job's --kv-budget, inside the warm start's trained windows (16-48). Below
    them accuracy falls off a cliff whose position moves with the float path: the 400-step assets on an AMD EPYC keep
    0.78 of the worked answers' 0.91 at 20 (12: 0.09, 16: 0.83, 24: 0.87, 32: 0.91; 46 worked answers of 128), #45.
    """
    paths = build_assets(tmp_path, AssetsConfig(), log=None)
    model = Qwen2ForCausalLM.from_pretrained(str(paths.model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(paths.model_dir))
    rows = load_rows(paths, "test")[:128]

    def scores(**kwargs) -> tuple[float, float, float]:
        """accuracy, fraction of bare answers, accuracy of the worked answers"""
        gens = generate(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=96, **kwargs)
        correct = [task_reward(g.text, r["label"], g.finish_reason) for g, r in zip(gens, rows)]
        worked = [c for c, g in zip(correct, gens) if not g.text.startswith("#")]
        return sum(correct) / len(rows), 1 - len(worked) / len(rows), sum(worked) / max(1, len(worked))

    greedy, bare, worked = scores()
    assert greedy <= 0.5 and bare >= 0.5 and worked >= 0.8
    sampled, sampled_bare, sampled_worked = scores(temperature=1.0)
    assert 0.25 <= sampled <= 0.7 and sampled_worked >= 0.6
    assert scores(window=20, keep_prompt=True)[2] >= 0.8 * worked
    assert scores(window=8, n_sink=2)[2] <= 0.3
