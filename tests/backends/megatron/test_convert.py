"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py on a tiny Qwen2 (CPU, gloo).

HF -> Megatron distributed checkpoint saved at TP=2 -> HF loaded at TP=1 / PP=2 must give back the very
same tensors (the torch_dist format reshards on load), plus config and tokenizer files.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")
from safetensors.torch import load_file  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_qwen2(path) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=128)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 128}, f)
    return load_file(os.path.join(path, "model.safetensors"))


def test_converter_arguments_are_validated(tmp_path):
    from slime_sparse.backends.megatron.convert import hf_to_megatron, megatron_to_hf

    _tiny_qwen2(tmp_path / "hf")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "out"), tp=4)  # 2 KV heads
    with pytest.raises(ValueError, match="--dtype"):
        hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "out"), dtype="fp8")
    with pytest.raises(ValueError, match="not a slime_sparse Megatron checkpoint"):
        megatron_to_hf(str(tmp_path / "hf"), str(tmp_path / "out"))


def test_conversion_keeps_the_source_dtype_unless_asked(tmp_path):
    """An fp32 model converts to fp32 (it used to become bf16 by default), a bf16 one to bf16; --dtype still wins."""
    from slime_sparse.backends.megatron.convert import checkpoint_dtype, converter_parser, stored_dtype

    _tiny_qwen2(tmp_path / "fp32")
    assert stored_dtype(str(tmp_path / "fp32")) == "float32"
    Qwen2ForCausalLM.from_pretrained(tmp_path / "fp32").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert stored_dtype(str(tmp_path / "bf16")) == "bfloat16"
    parser = converter_parser("", "--hf-dir", "", "", "")
    assert parser.parse_args(["--hf-dir", "x", "--out-dir", "y"]).dtype is None  # None: the source's
    assert parser.parse_args(["--hf-dir", "x", "--out-dir", "y", "--dtype", "bfloat16"]).dtype == "bfloat16"
    ckpt = tmp_path / "mcore"
    ckpt.mkdir()
    meta = {"hf_config": {"dtype": "bfloat16"}}
    (ckpt / "slime_sparse_megatron.json").write_text(json.dumps(meta))
    assert checkpoint_dtype(str(ckpt)) == "bfloat16"  # a learner's checkpoint: the HF config it came from
    (ckpt / "slime_sparse_megatron.json").write_text(json.dumps({**meta, "params_dtype": "float32"}))
    assert checkpoint_dtype(str(ckpt)) == "float32"  # what the converter wrote


@pytest.mark.megatron
@pytest.mark.slow
def test_hf_megatron_hf_round_trip_is_exact(tmp_path, monkeypatch):
    # the tools hide the GPUs (CUDA_VISIBLE_DEVICES="") in this process: undone after the test, or a later
    # ray.init(num_gpus=...) in the same pytest process refuses to start
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    hf_dir, mcore_dir, back_dir = tmp_path / "hf", tmp_path / "mcore", tmp_path / "back"
    original = _tiny_qwen2(hf_dir)
    # no --dtype: the fp32 source stays fp32 both ways, hence the exact round trip
    _tool("convert_hf_to_megatron").main(["--hf-dir", str(hf_dir), "--out-dir", str(mcore_dir), "--tp", "2"])
    meta = json.loads((mcore_dir / "slime_sparse_megatron.json").read_text())
    assert meta["saved_with"] == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    assert (mcore_dir / "hf_extra" / "tokenizer_config.json").exists()

    _tool("convert_megatron_to_hf").main(["--megatron-dir", str(mcore_dir), "--out-dir", str(back_dir), "--pp", "2"])
    restored = load_file(os.path.join(back_dir, "model.safetensors"))
    assert set(restored) == set(original)
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name
    assert json.loads((back_dir / "config.json").read_text())["model_type"] == "qwen2"
    assert (back_dir / "tokenizer_config.json").exists()
    reloaded = Qwen2ForCausalLM.from_pretrained(back_dir)  # a valid HF directory
    assert reloaded.config.num_hidden_layers == 2
