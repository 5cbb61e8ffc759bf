"""slime's model architecture flags (Megatron-LM's, as slime scripts pass them from scripts/models/*.sh), accepted
and checked against --hf-checkpoint's config.json.

Both learners and both engines read the architecture from config.json, so these flags set nothing: one that
agrees is accepted silently, one that disagrees is a one-line error naming the flag and config.json's value (a
script for another model size, say). A flag not given says nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


def _heads(c: dict) -> int:
    return int(c["num_attention_heads"])


def _rope(c: dict) -> dict:
    return dict(c.get("rope_parameters") or c.get("rope_scaling") or {})


def _has_rope(c: dict) -> bool:
    return "rope_theta" in c or "rope_parameters" in c


@dataclass(frozen=True)
class ArchFlag:
    kind: type | None  # the argument's type; None: a switch (given = the model has the property)
    reads: str  # what of config.json it is checked against, for the message
    value: Callable[[dict], Any]  # the flag's value config.json implies


ARCH_FLAGS: dict[str, ArchFlag] = {
    "--num-layers": ArchFlag(int, "num_hidden_layers", lambda c: int(c["num_hidden_layers"])),
    "--hidden-size": ArchFlag(int, "hidden_size", lambda c: int(c["hidden_size"])),
    "--ffn-hidden-size": ArchFlag(int, "intermediate_size", lambda c: int(c["intermediate_size"])),
    "--num-attention-heads": ArchFlag(int, "num_attention_heads", _heads),
    "--group-query-attention": ArchFlag(None, "num_key_value_heads", lambda c: True),  # MHA is GQA with one group each
    "--num-query-groups": ArchFlag(int, "num_key_value_heads",
                                   lambda c: int(c.get("num_key_value_heads") or _heads(c))),
    "--kv-channels": ArchFlag(int, "head_dim", lambda c: int(c.get("head_dim") or int(c["hidden_size"]) // _heads(c))),
    "--vocab-size": ArchFlag(int, "vocab_size", lambda c: int(c["vocab_size"])),
    "--max-position-embeddings": ArchFlag(int, "max_position_embeddings", lambda c: int(c["max_position_embeddings"])),
    "--swiglu": ArchFlag(None, "hidden_act", lambda c: c.get("hidden_act", "silu") in ("silu", "swish")),
    "--normalization": ArchFlag(str, "rms_norm_eps", lambda c: "RMSNorm" if "rms_norm_eps" in c else "LayerNorm"),
    "--norm-epsilon": ArchFlag(float, "rms_norm_eps",
                               lambda c: float(c.get("rms_norm_eps", c.get("layer_norm_eps", 1e-5)))),
    "--use-rotary-position-embeddings": ArchFlag(None, "rope_theta", _has_rope),
    "--position-embedding-type": ArchFlag(str, "rope_theta", lambda c: "rope" if _has_rope(c) else "learned_absolute"),
    "--rotary-base": ArchFlag(float, "rope_theta",
                              lambda c: float(_rope(c).get("rope_theta", c.get("rope_theta", 1e4)))),
    "--rotary-percent": ArchFlag(float, "partial_rotary_factor", lambda c: float(c.get("partial_rotary_factor", 1.0))),
    # Qwen2 has q/k/v biases and no others (config.json says so by its model_type); Llama's attention_bias adds them
    # to o_proj too, which --disable-bias-linear --add-qkv-bias cannot express
    "--disable-bias-linear": ArchFlag(None, "mlp_bias / attention_bias", lambda c: not c.get("mlp_bias", False) and (
        c.get("model_type") == "qwen2" or not c.get("attention_bias", False))),
    "--add-qkv-bias": ArchFlag(None, "model_type / attention_bias",
                               lambda c: c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False))),
    "--qk-layernorm": ArchFlag(None, "model_type", lambda c: str(c.get("model_type", "")).startswith("qwen3")),
    "--untie-embeddings-and-output-weights": ArchFlag(None, "tie_word_embeddings",
                                                      lambda c: not c.get("tie_word_embeddings", True)),
}


def arch_help(flag: str) -> str:
    return (f"slime's (Megatron-LM's) architecture flag, accepted and checked against --hf-checkpoint's config.json "
            f"({ARCH_FLAGS[flag].reads}), which is what sets the architecture here")


def check_arch_flags(given: dict[str, Any], hf_config: dict, where: str) -> None:
    """Each flag of `given` ({flag: parsed value, True for a switch}) agrees with `hf_config`, the config.json at
    `where`; else ValueError naming the flag and config.json's value."""
    for flag, value in given.items():
        spec = ARCH_FLAGS[flag]
        try:
            implied = spec.value(hf_config)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{flag}: {where} has no usable {spec.reads} to check it against") from None
        agree = math.isclose(value, implied, rel_tol=1e-6) if spec.kind is float else value == implied
        if not agree:
            said = f"{flag}" if spec.kind is None else f"{flag} {value}"
            has = f"{spec.reads} says otherwise" if spec.kind is None else f"{spec.reads} implies {implied}"
            raise ValueError(f"{said} disagrees with {where} ({has}): the architecture is read from config.json; "
                             f"drop the flag or give the model it describes")
