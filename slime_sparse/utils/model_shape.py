"""The architecture facts memory depends on, read from a Hugging Face config.json: what the embedded engine sizes
its cache and admission by (slime_sparse/kv/engine_memory.py) and what the memory planner counts
(slime_sparse/planner). Pure arithmetic, no imports of the project.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts memory depends on (Qwen2 / Llama style decoder)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head (head_dim weights each)

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelShape":
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                num_layers=int(config["num_hidden_layers"]), hidden_size=hidden, num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias
                attention_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False)),
                qk_norm=config.get("model_type") == "qwen3",
            )
        except KeyError as exc:
            raise ValueError(f"HF config lacks {exc.args[0]!r}, needed to plan memory") from None

    def num_parameters(self) -> int:
        h, d, kv = self.hidden_size, self.head_dim, self.num_kv_heads
        attn = h * self.num_heads * d + 2 * h * kv * d + self.num_heads * d * h
        if self.attention_bias:
            attn += self.num_heads * d + 2 * kv * d
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h + (2 * d if self.qk_norm else 0)  # RMSNorm weights
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h  # + the final norm

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def query_ring_bytes(self, window: int, dtype_bytes: int) -> int:
        """The plugin's per-request ring of `window` post-RoPE queries, over all layers."""
        return self.num_layers * window * self.num_heads * self.head_dim * dtype_bytes
