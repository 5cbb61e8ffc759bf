"""A tiny Qwen2 model built locally from a config (random weights, nothing downloaded).

The defaults give ~0.6M parameters: 4 layers, hidden 128, 4 query / 2 KV heads (GQA, so the KV
compression code sees grouped heads as in real Qwen2.5 models), MLP 256, tied embeddings. MLP 512
(~1M parameters) learns the default task no better per step and costs ~35 % more time per step
on a CPU, and every second counts in the CPU demo.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM


@dataclass(frozen=True)
class TinyModelConfig:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 512  # longest prompt + response the model will see
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    def validate(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head dim {self.hidden_size // self.num_heads} must be even (RoPE rotates pairs)")


def tiny_qwen2_config(tokenizer: PreTrainedTokenizerBase, config: TinyModelConfig = TinyModelConfig()) -> Qwen2Config:
    """A Qwen2Config whose vocabulary and special ids match `tokenizer`."""
    config.validate()
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, config: TinyModelConfig = TinyModelConfig(), seed: int = 0
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2ForCausalLM; the same seed gives the same weights."""
    hf_config = tiny_qwen2_config(tokenizer, config)
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's RNG stream
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(hf_config)
    # The tokenizer has no chat template; tell generate() which ids to use.
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding / LM head counts once)."""
    return sum(p.numel() for p in model.parameters())
