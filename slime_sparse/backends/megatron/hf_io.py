"""Hugging Face weights in and out of a (tensor / pipeline parallel) megatron-core GPTModel.

`load_hf_weights` fills this rank's shards from an HF directory (or any name -> tensor mapping);
`export_hf_weights` gathers the shards of every rank and yields full tensors under HF names, which is
what both `tools/convert_megatron_to_hf.py` and the learner's weight sync consume. Both go through the
rules of `weight_mapping`, the single source of truth for names and layouts.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from . import weight_mapping as wm
from .model_config import ModelSpec

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"


class HFWeights(Mapping[str, Tensor]):
    """Lazy read-only view of the safetensors files of an HF directory (single file or sharded index)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, HF_INDEX)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(path, HF_SINGLE)):
            files = [HF_SINGLE]
        else:
            raise ValueError(f"{path!r} has no {HF_SINGLE} or {HF_INDEX}: only safetensors checkpoints are supported")
        self._handles = [safe_open(os.path.join(path, f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> Tensor:
        return self._where[name].get_tensor(name)

    def stored_dtype(self, name: str) -> str:
        """safetensors' name of the tensor's dtype ("F32", "BF16", ...), read from the header alone."""
        return self._where[name].get_slice(name).get_dtype()

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def layer_offset(model: torch.nn.Module, pp_rank: int | None = None) -> int:
    """Global index of this pipeline stage's first transformer layer."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, pp_rank=pp_rank)


def uses_te_fused_norms(model: torch.nn.Module) -> bool:
    return any(n.endswith("linear_qkv.layer_norm_weight") for n, _ in model.named_parameters())


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, spec: ModelSpec, hf: Mapping[str, Tensor]) -> None:
    """Copy HF tensors into this rank's parameters (TP slice of its pipeline stage). Every parameter must
    be covered and every shape must match, else ValueError."""
    tp_rank, tp_size = _tp()
    rules = wm.rules_by_name(spec, te_fused_norms=uses_te_fused_norms(model))
    offset = layer_offset(model)
    padded = model.vocab_size
    for local_name, param in model.named_parameters():
        name = wm.to_global_name(local_name, offset)
        rule = rules.get(name)
        if rule is None:
            raise ValueError(f"Megatron parameter {name!r} has no Hugging Face counterpart in the {spec.model_type} mapping")
        missing = [n for n in rule.hf_names if n not in hf]
        if missing:
            raise ValueError(f"HF checkpoint lacks {missing} (needed for {name})")
        value = wm.hf_to_shard(rule, [hf[n] for n in rule.hf_names], spec, padded, tp_rank, tp_size)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: mapped HF shape {tuple(value.shape)} != Megatron shard shape {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))


def _pipeline_owner(name: str, spec: ModelSpec, pp_size: int) -> int:
    """Pipeline stage that holds Megatron parameter `name` (uniform layer split)."""
    match = wm._LAYER_RE.match(name)
    if match:
        return int(match.group(1)) // (spec.num_layers // pp_size)
    return 0 if name.startswith("embedding.") else pp_size - 1


@torch.no_grad()
def export_hf_weights(model: torch.nn.Module, spec: ModelSpec, *, grads: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF name, full tensor) for the whole model, on every rank (a collective: all ranks must
    iterate it to the end). TP shards are all-gathered; with PP the owning stage broadcasts.
    `grads=True` exports the parameters' gradients instead (zeros where there is none), for checks."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    te = uses_te_fused_norms(model)
    offset = layer_offset(model)
    local = {wm.to_global_name(n, offset): p for n, p in model.named_parameters()}
    for rule in wm.param_rules(spec, te_fused_norms=te):
        owner = _pipeline_owner(rule.megatron_name, spec, pp_size)
        full = None
        if owner == pp_rank:
            param = local[rule.megatron_name]
            shard = _grad_or_zeros(param) if grads else param.detach().contiguous()
            if tp_size > 1 and rule.kind != "replicated":
                parts = [torch.empty_like(shard) for _ in range(tp_size)]
                dist.all_gather(parts, shard, group=ps.get_tensor_model_parallel_group())
            else:
                parts = [shard.clone()]  # a snapshot: the exported tensors must not alias live parameters
            full = wm.unshard(rule, parts)
        if pp_size > 1:
            full = _broadcast_from_stage(full, owner)
        yield from wm.full_to_hf_named(rule, full, spec)


def _grad_or_zeros(param: torch.nn.Parameter) -> Tensor:
    grad = getattr(param, "main_grad", None)  # Megatron DDP accumulates into main_grad
    grad = param.grad if grad is None else grad
    return torch.zeros_like(param) if grad is None else grad.detach().contiguous()


def _broadcast_from_stage(tensor: Tensor | None, owner_stage: int) -> Tensor:
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    src = dist.get_global_rank(group, owner_stage)
    meta = [None if tensor is None else (tuple(tensor.shape), tensor.dtype)]
    dist.broadcast_object_list(meta, src=src, group=group)
    if tensor is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        tensor = torch.empty(meta[0][0], dtype=meta[0][1], device=device)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def save_hf_checkpoint(
    weights: Iterable[tuple[str, Tensor]],
    out_dir: str,
    hf_config: dict,
    *,
    max_shard_bytes: int = 4 << 30,
    dtype: torch.dtype | None = None,
) -> None:
    """Write an HF directory: config.json plus safetensors shards (with an index when more than one)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu", dtype=dtype or tensor.dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, HF_SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        with open(os.path.join(out_dir, HF_INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)


def bucketed(weights: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group a weight stream into buckets of about `bucket_bytes` (a tensor larger than that gets its own),
    the unit in which weights are sent to rollout engines."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket

