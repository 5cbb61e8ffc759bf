"""`--threads`: one rule for training, evaluation and the tiny recipe, resolved once and written into config.yaml."""
from __future__ import annotations

import json
import struct

import torch
import yaml

from slime_sparse.utils.threads import PARAMS_PER_THREAD, default_threads, model_parameters, torch_threads


def test_the_rule_follows_the_model_size_within_the_cores():
    assert default_threads(600_000, cores=2) == 1  # the tiny recipe's model: per-op overhead, one thread
    assert default_threads(135_000_000, cores=16) == 2  # SmolLM2-135M
    assert default_threads(1_500_000_000, cores=16) == 16  # capped by the cores
    assert default_threads(1_500_000_000, cores=1) == 1
    assert default_threads(None, cores=8) == 8  # size unknown: torch's own default
    assert default_threads(PARAMS_PER_THREAD * 3, cores=64) == 3


def test_parameters_are_read_from_the_safetensors_headers(tmp_path, tiny_assets):
    assets = tiny_assets()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    # tied embeddings are stored once, as transformers counts them
    assert model_parameters(str(assets.model_dir)) == sum(p.numel() for p in model.parameters())
    header = json.dumps({"__metadata__": {}, "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
                         "b": {"dtype": "F32", "shape": [5], "data_offsets": [48, 68]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(68))
    assert model_parameters(str(tmp_path)) == 17
    assert model_parameters(str(tmp_path / "missing")) is None


def test_the_resolved_threads_are_in_the_config_and_config_yaml_reruns_with_them(tiny_assets, tmp_path):
    from slime_sparse.config_loader import load_config, save_config

    assets = tiny_assets()
    base = ["--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path)]
    cfg = load_config(base)
    assert cfg.train.threads == 1  # a ~20k-parameter model
    save_config(cfg, str(tmp_path / "config.yaml"))
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["threads"] == 1
    assert load_config(["--config", str(tmp_path / "config.yaml")]).train.threads == 1
    assert load_config(base + ["--threads", "3"]).train.threads == 3


def test_train_and_eval_compute_on_the_configured_threads(tiny_assets, tmp_path, monkeypatch):
    import slime_sparse.eval.cli as eval_module
    import slime_sparse.train as train_module

    assets = tiny_assets()
    seen = {}
    monkeypatch.setattr(train_module, "train", lambda cfg, stop: seen.setdefault("train", torch.get_num_threads()))

    def evaluate(*_a, **_k):
        seen["eval"] = torch.get_num_threads()
        return {"pass@1": 0.0}

    monkeypatch.setattr(eval_module, "evaluate", evaluate)
    before = torch.get_num_threads()
    flags = ["--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path), "--threads", "2",
             "--custom-rm-path", "slime_sparse.tasks.repeated_add:task_reward", "--rm-num-workers", "0"]
    assert train_module.main(flags + ["--run-dir", str(tmp_path / "run")]) == 0
    assert eval_module.main(flags + ["--output", str(tmp_path / "report.json")]) == 0
    assert seen == {"train": 2, "eval": 2}
    assert torch.get_num_threads() == before  # restored for the caller


def test_torch_threads_restores_on_error():
    before = torch.get_num_threads()
    try:
        with torch_threads(before + 1):
            assert torch.get_num_threads() == before + 1
            raise RuntimeError
    except RuntimeError:
        pass
    assert torch.get_num_threads() == before
