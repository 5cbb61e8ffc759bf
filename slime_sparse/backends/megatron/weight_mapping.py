"""One mapping between Hugging Face (Qwen2 / Llama) and megatron-core GPTModel parameters.

It serves both checkpoint conversion (tools/convert_*.py) and weight sync to rollout engines, so the two
can never disagree. Everything here is a pure function of tensors: no process groups, no Megatron import.

Layouts (Megatron side, full = the tensor a TP=1 model holds):
- `linear_qkv` ([(H + 2 * G) * d, hidden], bias likewise): grouped by KV head (query group) g, each
  group is [its H/G query heads, its key head, its value head]. Column-parallel splitting into TP chunks
  along dim 0 then gives each rank whole groups, which is why TP must divide the number of KV heads.
- `linear_fc1` ([2 * ffn, hidden]): [gate; up] at TP=1, but each TP rank holds [gate_r; up_r] of its
  own ffn slice, so the sharded layout is *not* a plain chunk of the full tensor.
- `linear_proj`, `linear_fc2`: row-parallel, split along dim 1.
- `word_embeddings`, `output_layer`: vocab-parallel, rows padded with zeros to the padded vocabulary.
- norms: replicated.
With Transformer Engine the pre-attention / pre-MLP RMSNorm weights live inside the fused linear layers
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`); `te_fused_norms=True` names them so.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from .model_config import ModelSpec

KINDS = ("replicated", "row", "vocab", "qkv", "gate_up")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ParamRule:
    """How one Megatron parameter (global layer numbering) is made of HF tensors."""

    megatron_name: str
    hf_names: tuple[str, ...]
    kind: str


def param_rules(spec: ModelSpec, *, te_fused_norms: bool = False) -> list[ParamRule]:
    """Every parameter of the full (unsharded, all stages) GPTModel, in HF export order."""
    rules = [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    norm_in = "self_attention.linear_qkv.layer_norm_weight" if te_fused_norms else "input_layernorm.weight"
    norm_mlp = "mlp.linear_fc1.layer_norm_weight" if te_fused_norms else "pre_mlp_layernorm.weight"
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        rules += [
            ParamRule(m + norm_in, (h + "input_layernorm.weight",), "replicated"),
            ParamRule(m + "self_attention.linear_qkv.weight", tuple(attn + p + "_proj.weight" for p in "qkv"), "qkv"),
        ]
        if spec.qkv_bias:
            rules.append(ParamRule(m + "self_attention.linear_qkv.bias", tuple(attn + p + "_proj.bias" for p in "qkv"), "qkv"))
        rules += [
            ParamRule(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
            ParamRule(m + norm_mlp, (h + "post_attention_layernorm.weight",), "replicated"),
            ParamRule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up"),
            ParamRule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
        ]
    rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not spec.tie_word_embeddings:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


def rules_by_name(spec: ModelSpec, *, te_fused_norms: bool = False) -> dict[str, ParamRule]:
    rules = {r.megatron_name: r for r in param_rules(spec, te_fused_norms=te_fused_norms)}
    if spec.tie_word_embeddings:
        # With pipeline parallelism the last stage keeps its own copy of the tied embedding.
        rules["output_layer.weight"] = ParamRule("output_layer.weight", ("model.embed_tokens.weight",), "vocab")
    return rules


# ----------------------------------------------------------------------------- layer numbering


def to_global_name(local_name: str, layer_offset: int) -> str:
    """`decoder.layers.{i}.x` of a pipeline stage -> the model-wide layer index i + offset."""
    match = _LAYER_RE.match(local_name)
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}" if match else local_name


def is_megatron_weight(name: str) -> bool:
    """Parameters / state entries that carry weights (TE adds `_extra_state` bookkeeping entries)."""
    return not name.endswith("_extra_state")


# ----------------------------------------------------------------------------- full-layout merges


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, spec: ModelSpec) -> Tensor:
    """HF q/k/v projections (weights [out, in] or biases [out]) -> Megatron's grouped QKV layout."""
    g, hpg, d = spec.num_kv_heads, spec.heads_per_group, spec.head_dim
    tail = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(g, hpg * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1
    )  # [G, (hpg + 2) * d, ...]
    return grouped.reshape(g * (hpg + 2) * d, *tail)


def split_qkv(qkv: Tensor, spec: ModelSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `merge_qkv`."""
    g, hpg, d = spec.num_kv_heads, spec.heads_per_group, spec.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (hpg + 2) * d, *tail)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return q.reshape(g * hpg * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)


def pad_vocab(weight: Tensor, padded_vocab: int) -> Tensor:
    if padded_vocab < weight.shape[0]:
        raise ValueError(f"padded vocabulary {padded_vocab} is smaller than the model's {weight.shape[0]}")
    pad = weight.new_zeros(padded_vocab - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


def hf_to_full(rule: ParamRule, hf: list[Tensor], spec: ModelSpec, padded_vocab: int) -> Tensor:
    """HF tensors of `rule` -> the full (TP=1) Megatron tensor."""
    if rule.kind == "qkv":
        return merge_qkv(*hf, spec)
    if rule.kind == "gate_up":
        return torch.cat(hf, dim=0)
    if rule.kind == "vocab":
        return pad_vocab(hf[0], padded_vocab)
    return hf[0]


def full_to_hf(rule: ParamRule, full: Tensor, spec: ModelSpec) -> list[Tensor]:
    """Inverse of `hf_to_full` (drops the vocabulary padding)."""
    if rule.kind == "qkv":
        return list(split_qkv(full, spec))
    if rule.kind == "gate_up":
        return list(torch.chunk(full, 2, dim=0))
    if rule.kind == "vocab":
        return [full[: spec.vocab_size]]
    return [full]


# ----------------------------------------------------------------------------- tensor parallel


def shard(rule: ParamRule, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """The slice of a full Megatron tensor that TP rank `tp_rank` holds."""
    if rule.kind == "replicated" or tp_size == 1:
        return full
    if rule.kind in ("qkv", "vocab"):
        return torch.chunk(full, tp_size, dim=0)[tp_rank]
    if rule.kind == "row":
        return torch.chunk(full, tp_size, dim=1)[tp_rank]
    if rule.kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]], dim=0)
    raise ValueError(f"unknown parameter kind {rule.kind!r} for {rule.megatron_name}")


def unshard(rule: ParamRule, shards: list[Tensor]) -> Tensor:
    """Inverse of `shard`: the full tensor from the TP ranks' slices (in rank order)."""
    if rule.kind == "replicated" or len(shards) == 1:
        return shards[0]
    if rule.kind in ("qkv", "vocab"):
        return torch.cat(shards, dim=0)
    if rule.kind == "row":
        return torch.cat(shards, dim=1)
    if rule.kind == "gate_up":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ValueError(f"unknown parameter kind {rule.kind!r} for {rule.megatron_name}")


def hf_to_shard(rule: ParamRule, hf: list[Tensor], spec: ModelSpec, padded_vocab: int, tp_rank: int, tp_size: int) -> Tensor:
    return shard(rule, hf_to_full(rule, hf, spec, padded_vocab), tp_rank, tp_size)


def full_to_hf_named(rule: ParamRule, full: Tensor, spec: ModelSpec) -> list[tuple[str, Tensor]]:
    return list(zip(rule.hf_names, full_to_hf(rule, full, spec)))
