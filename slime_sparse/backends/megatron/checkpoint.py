"""Checkpoints of the Megatron backend, two kinds.

Megatron distributed checkpoints (megatron.core.dist_checkpointing) of the GPT model (`save_model` /
`load_model`: the converters' format, and --ref-load):
    <dir>/            dist_checkpointing files (torch_dist format: resharding-capable, so a checkpoint
                      saved at TP=2 / PP=1 loads at TP=1 or PP=2)
    <dir>/slime_sparse_megatron.json   the HF config it came from, the ModelSpec and the saving layout
    <dir>/hf_extra/   tokenizer / generation files copied from the HF directory, for the way back

Training checkpoints of the Megatron learner (`save_training_checkpoint` / `load_training_checkpoint`, collective),
in the layout of `slime_sparse.utils.checkpoint`, so `latest_checkpoint`, `list_checkpoints` and pruning work
unchanged:
    <save_dir>/<name>/
        model/               HF export (config, safetensors, tokenizer): the weights, loadable anywhere
        optim/               optimizer state: CPU one torch file per rank; GPU a distributed checkpoint
        rng/rank*.pt         each rank's RNG streams, Megatron's tensor-parallel tracker included
        trainer_state.json   step, data_state, extra (+ the saving layout); written last

dist_checkpointing's torch_dist backend works with gloo on CPU (checked with megatron-core 0.16.1).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from slime_sparse.utils.checkpoint import MODEL_DIR, STATE_FILE, read_trainer_state, training_checkpoint_dir
from slime_sparse.utils.seed import get_rng_state, set_rng_state

from .hf_io import HFWeights, export_hf_weights, load_hf_weights, save_hf_checkpoint
from .model_config import ModelSpec

META_FILE = "slime_sparse_megatron.json"
HF_EXTRA_DIR = "hf_extra"
# Inside a training checkpoint (besides utils.checkpoint's model/ and trainer_state.json):
OPTIM_DIR = "optim"  # optimizer state
RNG_DIR = "rng"  # one RNG file per rank
LAYOUT_KEY = "megatron_layout"  # key in trainer_state.json's extra: the layout the per-rank files belong to
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


# ------------------------------------------------------------------------------------- training checkpoints
def rank_file(directory: str) -> str:
    """This rank's file in a directory of per-rank files (optimizer state on CPU, RNG streams)."""
    return os.path.join(directory, f"rank{dist.get_rank():05d}.pt")


def training_layout(optimizer: Any) -> dict:
    """What the per-rank files of a training checkpoint depend on."""
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "optimizer": optimizer.name,
    }


def save_training_checkpoint(path: str, *, model: torch.nn.Module, spec: ModelSpec, optimizer: Any, hf_config: dict,
                             side_files: str, tokenizer: Any, step: int, data_state: dict, extra: dict,
                             keep_last: int | None) -> str:
    """Collective, atomic training checkpoint at `path` of `model` (this rank's GPTModel stage) and `optimizer`
    (megatron.optimizer's, which saves itself); `side_files`: a directory whose tokenizer / generation files go
    into model/ too.

    Rank 0 stages a tmp directory (utils.checkpoint.training_checkpoint_dir), every rank writes its part
    into it, and once all are done rank 0 writes trainer_state.json, renames the directory to `path`,
    updates `latest` and prunes to `keep_last`. A crash before that leaves only a tmp-* directory.
    """
    rank = dist.get_rank()
    state_extra = {**extra, LAYOUT_KEY: training_layout(optimizer)}
    with contextlib.ExitStack() as stack:
        staged, error = None, None
        if rank == 0:
            try:
                staged = stack.enter_context(training_checkpoint_dir(
                    path, step=step, data_state=data_state, extra=state_extra, keep_last=keep_last))
            except Exception as exc:  # e.g. data_state not JSON: the other ranks must not wait for rank 0
                error = exc
        message = [staged, None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(message, src=0)
        staged, failure = message
        if error is not None:
            raise error
        if failure is not None:
            raise RuntimeError(f"checkpoint {path}: rank 0 could not stage it ({failure})")
        _write_training_files(staged, model=model, spec=spec, optimizer=optimizer, hf_config=hf_config,
                              side_files=side_files, tokenizer=tokenizer)
        dist.barrier()  # every rank's files are written before rank 0 commits (leaving this block)
    dist.barrier()  # the commit is visible to every rank before any returns
    return path


def _write_training_files(directory: str, *, model: torch.nn.Module, spec: ModelSpec, optimizer: Any,
                          hf_config: dict, side_files: str, tokenizer: Any) -> None:
    """Collective: fill a staged checkpoint directory (HF export by rank 0, per-rank optimizer and RNG)."""
    from megatron.core import tensor_parallel

    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(os.path.join(directory, OPTIM_DIR))
        os.makedirs(os.path.join(directory, RNG_DIR))
    dist.barrier()  # the directories exist before any rank writes into them
    weights = export_hf_weights(model, spec)  # collective (TP all-gather): every rank iterates, rank 0 writes
    if rank == 0:
        model_dir = os.path.join(directory, MODEL_DIR)
        save_hf_checkpoint(weights, model_dir, hf_config)
        if os.path.isdir(side_files):  # generation config, tokenizer files
            copy_hf_side_files(side_files, model_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(model_dir)
    else:
        for _ in weights:
            pass
    optimizer.save(os.path.join(directory, OPTIM_DIR))
    rng = {"host": get_rng_state(), "tensor_parallel": tensor_parallel.get_cuda_rng_tracker().get_states()}
    torch.save(rng, rank_file(os.path.join(directory, RNG_DIR)))


def load_training_checkpoint(path: str, *, model: torch.nn.Module, spec: ModelSpec, optimizer: Any) -> dict:
    """Collective: restore weights, optimizer and RNG written by `save_training_checkpoint`.

    Returns {"step", "data_state", "extra"}. The saving layout (world size, TP, PP) must be this one:
    optimizer and RNG states are per rank. To continue at another layout, start a new run from the
    checkpoint's model/ directory (--hf-checkpoint), which carries the weights but not the moments.
    """
    from megatron.core import tensor_parallel

    state = read_trainer_state(path)
    saved, layout = state["extra"].get(LAYOUT_KEY), training_layout(optimizer)
    if saved is None:
        raise ValueError(f"{path}: not written by the Megatron learner (no {LAYOUT_KEY!r} in its {STATE_FILE}); "
                         f"start from its weights with --hf-checkpoint {os.path.join(path, MODEL_DIR)}")
    if saved != layout:
        raise ValueError(f"{path} was saved with layout {saved}, this run has {layout}: resume with the "
                         "same world size and --tensor-model-parallel-size (or start from its model/ directory)")
    # The HF export reshards through the same mapping as the initial load: each rank reads its slices.
    load_hf_weights(model, spec, HFWeights(os.path.join(path, MODEL_DIR)))
    optimizer.load(os.path.join(path, OPTIM_DIR))
    rng = torch.load(rank_file(os.path.join(path, RNG_DIR)), map_location="cpu", weights_only=True)
    set_rng_state(rng["host"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tensor_parallel"])
    return state
