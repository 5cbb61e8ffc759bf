"""Megatron distributed checkpoints (megatron.core.dist_checkpointing) of the GPT model.

Layout of a checkpoint directory written here:
    <dir>/            dist_checkpointing files (torch_dist format: resharding-capable, so a checkpoint
                      saved at TP=2 / PP=1 loads at TP=1 or PP=2)
    <dir>/slime_sparse_megatron.json   the HF config it came from, the ModelSpec and the saving layout
    <dir>/hf_extra/   tokenizer / generation files copied from the HF directory, for the way back

dist_checkpointing's torch_dist backend works with gloo on CPU (checked with megatron-core 0.16.1).
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from .model_config import ModelSpec

META_FILE = "slime_sparse_megatron.json"
HF_EXTRA_DIR = "hf_extra"
# Files of an HF directory that are not weights and travel with the checkpoint.
HF_SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_model(model: torch.nn.Module, path: str, *, hf_config: dict, hf_dir: str | None = None, extra_meta: dict | None = None) -> None:
    """Collective: every rank calls it with its model stage."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    if _rank0():
        os.makedirs(path, exist_ok=True)
    _barrier()
    dist_checkpointing.save(model.sharded_state_dict(), path)
    if _rank0():
        meta = {
            "hf_config": hf_config,
            "spec": ModelSpec.from_hf_config(hf_config).to_dict(),
            "saved_with": {
                "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
                "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            },
            **(extra_meta or {}),
        }
        with open(os.path.join(path, META_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        if hf_dir is not None:
            copy_hf_side_files(hf_dir, os.path.join(path, HF_EXTRA_DIR))
    _barrier()


def load_model(model: torch.nn.Module, path: str) -> None:
    """Collective: fill this rank's shards from a distributed checkpoint (any saving layout)."""
    from megatron.core import dist_checkpointing

    if not os.path.isfile(os.path.join(path, META_FILE)):
        raise ValueError(f"{path!r} is not a slime_sparse Megatron checkpoint (no {META_FILE})")
    state = dist_checkpointing.load(model.sharded_state_dict(), path)
    model.load_state_dict(state, strict=True)


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path!r} is not a slime_sparse Megatron checkpoint (no {META_FILE})")
    with open(meta_path, encoding="utf-8") as f:
        return json.load(f)


def copy_hf_side_files(src: str, dst: str) -> list[str]:
    """Copy tokenizer / generation files (whatever of HF_SIDE_FILES exists) from `src` to `dst`."""
    os.makedirs(dst, exist_ok=True)
    copied = []
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied
