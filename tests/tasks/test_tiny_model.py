"""The tiny random Qwen2 (slime_sparse/tasks/tiny_model.py): size, seeding, bad configs."""
from __future__ import annotations

import pytest
import torch

from slime_sparse.tasks.tiny_model import TinyModelConfig, build_tiny_model, count_parameters
from tests.tasks.common import MICRO_MODEL


def _qwen2_param_count(vocab: int, h: int, layers: int, heads: int, kv_heads: int, mlp: int) -> int:
    """Qwen2 parameters re-derived by hand: q/k/v have biases, o and the MLP do not, tied LM head."""
    head_dim = h // heads
    kv = kv_heads * head_dim
    attention = (h * h + h) + 2 * (h * kv + kv) + h * h
    per_layer = attention + 3 * h * mlp + 2 * h  # + input and post-attention RMSNorm weights
    return vocab * h + layers * per_layer + h  # + final norm


def test_tiny_model_default_size_and_config(tokenizer):
    model = build_tiny_model(tokenizer)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 128, 4, 2)
    assert cfg.intermediate_size == 256 and cfg.vocab_size == len(tokenizer)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    expected = _qwen2_param_count(len(tokenizer), 128, 4, 4, 2, 256)
    assert count_parameters(model) == expected
    assert 0.55e6 < expected < 0.65e6


def test_tiny_model_is_seeded(tokenizer):
    a = build_tiny_model(tokenizer, MICRO_MODEL, seed=1)
    b = build_tiny_model(tokenizer, MICRO_MODEL, seed=1)
    c = build_tiny_model(tokenizer, MICRO_MODEL, seed=2)
    assert count_parameters(a) == _qwen2_param_count(len(tokenizer), 32, 2, 4, 2, 64)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_tiny_model_rejects_bad_config(tokenizer):
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_tiny_model(tokenizer, TinyModelConfig(num_heads=4, num_kv_heads=3))
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_model(tokenizer, TinyModelConfig(hidden_size=130, num_heads=4))
