"""Our decode body for Qwen2 / Llama (nano-vllm's model shape): one new token per row through every layer with few
kernels, reading the HF modules' own weights. Prefill stays on HF's body (its shapes vary; it runs eagerly once per
prompt); contract.py checks that this body equals HF's forward (fp32) for both architectures.

Per layer: RMSNorm as one op (`F.rms_norm`), one qkv GEMM, RoPE from a cos / sin table indexed by position (for q and
k together), the cache write, attention (attention.py), one o GEMM, RMSNorm, one gate/up GEMM, SiLU x up, one down
GEMM. In float32 every step is HF's arithmetic; in a reduced dtype the norm rounds where HF's does (normalised value
to the model dtype, then the weight), and RoPE multiplies and adds in the model dtype as HF does (on CPU, bf16 decoding
through this body samples HF's tokens with HF's log-probs bit for bit: tests/rollout/embedded/test_decode_body.py).

Fused weights: `_fuse` concatenates q/k/v (and gate/up) once and makes each HF parameter's data a view into the
fused tensor (parameters that already are such views, fused by another engine over the same model, are used as they
are). State-dict names, shapes and parameter objects are unchanged, so the weight-sync protocol and every in-place
write (update_weights, load_state_dict, an optimiser step) land in the fused tensor. The body keeps every parameter
where it and the captured graphs read it: a parameter whose data is replaced (load_state_dict(assign=True)) is put
back there with its new values (`restore`), so the runner and its graphs stay; only a dtype or device conversion
(`model.to`) makes the engine build a new body (and a cache of the new dtype).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import decode_layer
from .cache import BudgetKVCache

logger = logging.getLogger(__name__)
ARCHITECTURES = ("qwen2", "llama")
_DYNAMIC_ROPE = ("dynamic", "longrope")  # inv_freq changes with the sequence length: a fixed table cannot hold it


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's Qwen2 / Llama RMSNorm: one op in float32; in a reduced dtype two, so that the normalised value (computed
    in float32 by torch's kernel) is rounded to the model dtype before the weight multiplies, as HF (and vLLM's
    kernel) round."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x, weight.shape, None, eps)


def unsupported(model: nn.Module) -> str | None:
    """Why this body cannot run `model` (None: it can); the engine then decodes through HF's body."""
    cfg = model.config
    if cfg.model_type not in ARCHITECTURES:
        return f"model_type {cfg.model_type!r} (the decode body knows {', '.join(ARCHITECTURES)})"
    body = model.base_model
    rope = getattr(body, "rotary_emb", None)
    if rope is None:
        return "no rotary_emb on the decoder body"
    if any(kind in str(getattr(rope, "rope_type", "default")) for kind in _DYNAMIC_ROPE):
        return f"rope_type {rope.rope_type!r} varies with the sequence length"
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(isinstance(getattr(attn, n, None), nn.Linear) for n in names) or \
                not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {attn.layer_idx}: projections are not the expected nn.Linear modules"
        if len({attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None}) > 1 or \
                (mlp.gate_proj.bias is None) != (mlp.up_proj.bias is None):
            return f"layer {attn.layer_idx}: some of q/k/v (or gate/up) have biases and others not"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "query / key norms (not Qwen2 / Llama attention)"
    return None


def _fused_already(parts: list[Tensor]) -> Tensor | None:
    """The tensor whose row blocks `parts` are, when they lie one after the other in one storage (fused before);
    else None."""
    first, rest = parts[0], parts[0].shape[1:]
    offset = first.storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.shape[1:] != rest or p.dtype != first.dtype or p.storage_offset() != offset \
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        offset += p.numel()
    shape = (sum(p.shape[0] for p in parts), *rest)
    return first.detach().as_strided(shape, torch.empty(shape, device="meta").stride(), first.storage_offset())


def _fuse(linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """One weight (and bias) whose row blocks hold the linears' parameters; each parameter's data becomes its view."""
    out = []
    for name in ("weight", "bias"):
        parts = [getattr(lin, name) for lin in linears]
        if parts[0] is None:
            out.append(None)
            continue
        fused = _fused_already(parts)
        if fused is None:
            fused = torch.cat([p.detach() for p in parts])
            start = 0
            for p in parts:
                p.data = fused[start : start + p.shape[0]]
                start += p.shape[0]
        out.append(fused)
    return out[0], out[1]


def _in_place(param: Tensor, data: Tensor) -> bool:
    return param.data_ptr() == data.data_ptr() and param.shape == data.shape and param.stride() == data.stride() \
        and param.dtype == data.dtype and param.device == data.device


@dataclass
class LayerWeights:
    """One decoder layer's tensors as the body reads them (fused ones owned here, the rest the HF parameters)."""

    norm1: nn.Module
    qkv: Tensor
    qkv_bias: Tensor | None
    o_proj: nn.Linear
    norm2: nn.Module
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down_proj: nn.Linear
    act: Callable[[Tensor], Tensor]


class DecodeBody:
    """`body(tokens [n], positions [n], cache) -> final hidden states [n, H]` for a decode step (`cache.begin` with
    a DecodeView done by the caller)."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the decode body does not support this model: {reason}")
        body, cfg = model.base_model, model.config
        self.model = model
        self.embed, self.norm = body.embed_tokens, body.norm
        self.n_q_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        attn0 = body.layers[0].self_attn
        self.head_dim, self.scale = attn0.head_dim, attn0.scaling
        self.layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
            self.layers.append(LayerWeights(layer.input_layernorm, qkv, qkv_bias, attn.o_proj,
                                            layer.post_attention_layernorm, gate_up, gate_up_bias, mlp.down_proj,
                                            mlp.act_fn))
        self.rope = self._rope_table(body.rotary_emb, cfg.max_position_embeddings)
        # where every parameter's data lives now: what this body (and a graph captured over it) reads
        self._pinned = [(p, p.data) for p in model.parameters()]

    def _rope_table(self, rotary: nn.Module, positions: int) -> Tensor:
        """[P, 2, d]: cos and sin of every position as HF's rotary embedding computes them (its own forward, in the
        model dtype), sin with the sign of rotate_half folded in: x * cos + roll(x, d / 2) * sin is HF's
        x * cos + rotate_half(x) * sin, bit for bit."""
        w = self.embed.weight
        with torch.no_grad():
            cos, sin = rotary(torch.empty(0, device=w.device, dtype=w.dtype),
                              torch.arange(positions, device=w.device)[None])
        half = self.head_dim // 2
        sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return torch.stack([cos[0], sin], dim=1).contiguous()

    def stale(self) -> bool:
        """True when a parameter's data was replaced since this body was built (`restore` puts it back)."""
        return not all(_in_place(p, data) for p, data in self._pinned)

    def restore(self) -> bool:
        """Put every parameter whose data was replaced back where this body and the graphs captured over it read it,
        with its new values; False (nothing changed) when one changed its dtype, device or shape: build a new body."""
        moved = [(p, data) for p, data in self._pinned if not _in_place(p, data)]
        if any((p.dtype, p.device, p.shape) != (data.dtype, data.device, data.shape) for p, data in moved):
            return False
        with torch.no_grad():
            for p, data in moved:
                data.copy_(p.data)
                p.data = data
        return True

    def __call__(self, tokens: Tensor, positions: Tensor, cache: BudgetKVCache) -> Tensor:
        table = self.rope[positions]  # [n, 2, d]: one gather for the step
        cos, sin = table[:, None, 0], table[:, None, 1]
        h = F.embedding(tokens, self.embed.weight)
        for i, lw in enumerate(self.layers):  # each half's temporaries die with its call (kv/engine_memory.py counts them)
            h = h + self._attention(i, lw, rms_norm(h, lw.norm1.weight, lw.norm1.variance_epsilon), cos, sin, cache)
            h = h + self._mlp(lw, rms_norm(h, lw.norm2.weight, lw.norm2.variance_epsilon))
        return rms_norm(h, self.norm.weight, self.norm.variance_epsilon)

    def _attention(self, i: int, lw: LayerWeights, x: Tensor, cos: Tensor, sin: Tensor, cache: BudgetKVCache) -> Tensor:
        n, d, hq, hkv = x.shape[0], self.head_dim, self.n_q_heads, self.n_kv_heads
        qkv = F.linear(x, lw.qkv, lw.qkv_bias).view(n, hq + 2 * hkv, d)
        del x
        qk = qkv[:, : hq + hkv]
        qk = (qk * cos).add_(torch.roll(qk, d // 2, dims=-1).mul_(sin))  # HF's rounding: q * cos + rot(q) * sin
        attn = decode_layer(cache, i, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :], self.scale)
        del qk, qkv
        return lw.o_proj(attn.reshape(n, hq * d))

    @staticmethod
    def _mlp(lw: LayerWeights, x: Tensor) -> Tensor:
        gate, up = F.linear(x, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
        del x
        act = lw.act(gate).mul_(up)
        del gate, up
        return lw.down_proj(act)


def build(model: nn.Module) -> tuple[DecodeBody | None, str | None]:
    """(the body, None), or (None, why not): the engine decodes through HF's body then."""
    reason = unsupported(model)
    if reason is not None:
        logger.info("decoding through HF's modules: %s", reason)
        return None, reason
    return DecodeBody(model), None
