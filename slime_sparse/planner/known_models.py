"""The config.json fields memory depends on, for the models people size runs for, so a plan needs no download.

Copied from each model's published config.json (the base and -Instruct variants share them); tests check every
entry's parameter count against transformers building it on the meta device. A name is matched without its
organisation, case and an -Instruct / -Base / -Chat suffix: `Qwen/Qwen2.5-7B-Instruct`, `qwen2.5-7b` and
`Qwen2.5-7B` are one model.
"""
from __future__ import annotations

import re


def _qwen25(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> dict:
    return {"model_type": "qwen2", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied,
            "max_position_embeddings": 32768}


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool) -> dict:
    return {"model_type": "qwen3", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": tied, "attention_bias": False, "max_position_embeddings": 40960}


def _llama3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool, head_dim: int = 128) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": 128256,
            "tie_word_embeddings": tied, "attention_bias": False, "max_position_embeddings": 131072}


KNOWN_MODELS: dict[str, dict] = {
    "Qwen2.5-0.5B": _qwen25(896, 4864, 24, 14, 2, 151936, True),
    "Qwen2.5-1.5B": _qwen25(1536, 8960, 28, 12, 2, 151936, True),
    "Qwen2.5-3B": _qwen25(2048, 11008, 36, 16, 2, 151936, True),
    "Qwen2.5-7B": _qwen25(3584, 18944, 28, 28, 4, 152064, False),
    "Qwen2.5-14B": _qwen25(5120, 13824, 48, 40, 8, 152064, False),
    "Qwen2.5-32B": _qwen25(5120, 27648, 64, 40, 8, 152064, False),
    "Qwen2.5-72B": _qwen25(8192, 29568, 80, 64, 8, 152064, False),
    "Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, 8, True),
    "Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, 8, True),
    "Qwen3-4B": _qwen3(2560, 9728, 36, 32, 8, True),
    "Qwen3-8B": _qwen3(4096, 12288, 36, 32, 8, False),
    "Qwen3-14B": _qwen3(5120, 17408, 40, 40, 8, False),
    "Qwen3-32B": _qwen3(5120, 25600, 64, 64, 8, False),
    "Llama-3.2-1B": _llama3(2048, 8192, 16, 32, 8, True, head_dim=64),
    "Llama-3.2-3B": _llama3(3072, 8192, 28, 24, 8, True),
    "Llama-3.1-8B": _llama3(4096, 14336, 32, 32, 8, False),
    "Llama-3.1-70B": _llama3(8192, 28672, 80, 64, 8, False),
}
# Llama 3 and 3.1 share their shapes (3.1 only changed RoPE scaling and the context), as do Meta's spellings
ALIASES = {"llama-3-8b": "Llama-3.1-8B", "llama-3-70b": "Llama-3.1-70B", "meta-llama-3-8b": "Llama-3.1-8B",
           "meta-llama-3-70b": "Llama-3.1-70B", "meta-llama-3.1-8b": "Llama-3.1-8B",
           "meta-llama-3.1-70b": "Llama-3.1-70B"}
_SUFFIX = re.compile(r"-(instruct|base|chat)$")


def _key(name: str) -> str:
    return _SUFFIX.sub("", name.rsplit("/", 1)[-1].lower())


def known_config(name: str) -> dict | None:
    """The config fields of a known model, or None for a name this module does not know."""
    key = _key(name)
    by_key = {_key(n): n for n in KNOWN_MODELS}
    found = by_key.get(key) or ALIASES.get(key)
    return dict(KNOWN_MODELS[found]) if found else None
