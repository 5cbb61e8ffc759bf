"""Checkpoints that are never visible half-written: HF model exports and full training states.

A training checkpoint is a directory inside `save_dir` (the caller picks its name):

    <save_dir>/<name>/
        model/               HF format (config.json, *.safetensors, tokenizer files): loads with from_pretrained
        optimizer.pt         {"optimizer": state_dict, "scheduler": state_dict | None}
        rng.pt               python / numpy / torch CPU / torch CUDA RNG states (utils.seed.get_rng_state)
        trainer_state.json   {"format_version", "step", "data_state", "extra"}; written last
    <save_dir>/latest        the name of the newest checkpoint, replaced atomically

Atomicity: everything is written into `<save_dir>/tmp-<name>`, fsynced, and moved to `<save_dir>/<name>` by
one os.rename, so a directory not named tmp-* is complete. A crash mid-write leaves only a tmp-* directory;
the next training save, and a run that (re)starts (`tidy_save_dir`), removes every tmp-* directory of
`save_dir`, which therefore belongs to the checkpointer (one writer at a time). The `.pt` files hold only tensors and plain values and are read with
torch.load(weights_only=True).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from slime_sparse.utils.faults import fault_point
from slime_sparse.utils.seed import get_rng_state, set_rng_state

logger = logging.getLogger(__name__)

TMP_PREFIX = "tmp-"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
FORMAT_VERSION = 1


class UnreadableCheckpoint(ValueError):
    """A checkpoint marked complete whose files cannot be read (truncated or corrupted after it was written):
    the loop resumes from the previous one instead."""


# ----------------------------------------------------------------------------------------------- public API


def save_hf(model: torch.nn.Module, tokenizer: Any, path: str) -> str:
    """Export `model` (safetensors via save_pretrained) and `tokenizer` (may be None) to `path`, atomically."""
    with _atomic_dir(path, clean_all_tmp=False) as tmp:
        _write_model(model, tokenizer, tmp)
    return path


def save_training_state(
    path: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    step: int,
    data_state: dict,
    extra: dict | None = None,
    tokenizer: Any = None,
    keep_last: int | None = None,
) -> str:
    """Write a complete training checkpoint to `path`, point `<parent>/latest` at it, prune old ones.

    data_state and extra must be JSON-serialisable (they are stored in trainer_state.json, readable by eye).
    keep_last: keep only the newest `keep_last` checkpoints of the parent directory (None or 0: keep all).
    """
    with training_checkpoint_dir(path, step=step, data_state=data_state, extra=extra, keep_last=keep_last) as tmp:
        _write_model(model, tokenizer, os.path.join(tmp, MODEL_DIR))
        optim_state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        torch.save(optim_state, os.path.join(tmp, OPTIMIZER_FILE))
        torch.save(get_rng_state(), os.path.join(tmp, RNG_FILE))
    return path


@contextmanager
def training_checkpoint_dir(
    path: str, *, step: int, data_state: dict, extra: dict | None = None, keep_last: int | None = None
) -> Iterator[str]:
    """Stage a training checkpoint whose files the caller writes: yields an empty directory to fill.

    On a clean exit it writes trainer_state.json (last: it marks the content complete), moves the directory
    to `path` in one rename, points `<parent>/latest` at it and prunes to `keep_last`; on an exception it
    removes the directory. save_training_state is built on it; a multi-rank learner uses it on rank 0 while
    every rank writes its own shards into the yielded directory (all ranks must be done before the block
    exits). Arguments are validated (ValueError) before anything is created.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 0):
        raise ValueError(f"keep_last must be None or an int >= 0, got {keep_last!r}")
    trainer_state = {"format_version": FORMAT_VERSION, "step": step, "data_state": data_state, "extra": extra or {}}
    try:
        state_text = json.dumps(trainer_state, indent=2, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"data_state and extra must be JSON-serialisable (finite numbers): {err}") from err

    with _atomic_dir(path, clean_all_tmp=True) as tmp:
        yield tmp
        fault_point("checkpoint.staged")
        _write_text(os.path.join(tmp, STATE_FILE), state_text)  # last: marks the content complete

    fault_point("checkpoint.renamed")

    save_dir = os.path.dirname(os.path.abspath(path))
    _write_text_atomic(os.path.join(save_dir, LATEST_FILE), os.path.basename(os.path.abspath(path)) + "\n")
    if keep_last:
        prune_checkpoints(save_dir, keep_last)
    logger.info("saved checkpoint %s (step %d)", path, step)


def read_trainer_state(path: str) -> dict:
    """{"step", "data_state", "extra"} of the complete training checkpoint `path` (ValueError otherwise)."""
    state = _read_trainer_state(path)
    if state is None:
        raise ValueError(f"{path!r} is not a complete training checkpoint (no readable {STATE_FILE})")
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format_version')!r}, expected {FORMAT_VERSION}")
    return {"step": state["step"], "data_state": state["data_state"], "extra": state["extra"]}


def load_training_state(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    restore_rng: bool = True,
) -> dict:
    """Restore model weights (in place), optimizer, scheduler and RNG states from checkpoint `path`.

    Returns {"step": int, "data_state": dict, "extra": dict}. optimizer=None skips the optimizer (evaluation).
    """
    state = read_trainer_state(path)
    _load_weights(model, os.path.join(path, MODEL_DIR))
    opt_state = _read(os.path.join(path, OPTIMIZER_FILE), _torch_load)
    if optimizer is not None:
        optimizer.load_state_dict(opt_state["optimizer"])  # moves the state to each parameter's device
    if scheduler is not None:
        if opt_state["scheduler"] is None:
            raise ValueError(f"{path}: a scheduler was given but the checkpoint holds no scheduler state")
        scheduler.load_state_dict(opt_state["scheduler"])
    elif opt_state["scheduler"] is not None:
        logger.warning("%s holds a scheduler state but no scheduler was given: not restored", path)
    if restore_rng:
        set_rng_state(_read(os.path.join(path, RNG_FILE), _torch_load))
    logger.info("loaded checkpoint %s (step %d)", path, state["step"])
    return state


def list_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """Complete training checkpoints of `save_dir` as (step, path), oldest step first."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.startswith(TMP_PREFIX) or not os.path.isdir(path):
            continue
        state = _read_trainer_state(path)
        if state is not None and isinstance(state.get("step"), int):
            found.append((state["step"], path))
    return sorted(found)


def latest_checkpoint(save_dir: str) -> str | None:
    """Path of the checkpoint `<save_dir>/latest` names; if that one is gone, the complete one with the
    highest step; None when there is none."""
    marker = os.path.join(save_dir, LATEST_FILE)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as fh:
            name = fh.read().strip()
        path = os.path.join(save_dir, name)
        if name and _read_trainer_state(path) is not None:
            return path
        logger.warning("%s names %r, which is not a complete checkpoint: using the newest one", marker, name)
    checkpoints = list_checkpoints(save_dir)
    return checkpoints[-1][1] if checkpoints else None


def checkpoint_to_resume(path: str) -> str | None:
    """What `--load PATH` resumes: PATH when it is a complete checkpoint, else the latest one in it (None: none)."""
    return path if _read_trainer_state(path) is not None else latest_checkpoint(path)


def prune_checkpoints(save_dir: str, keep_last: int) -> list[str]:
    """Delete all but the `keep_last` highest-step checkpoints (never the one `latest` names); returns them."""
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    latest = latest_checkpoint(save_dir)
    doomed = [path for _, path in list_checkpoints(save_dir)[:-keep_last] if path != latest]
    for path in doomed:
        # Rename first, so a crash mid-delete leaves a tmp-* directory (removed by the next save), never a
        # half-deleted directory that still looks like a checkpoint.
        trash = os.path.join(save_dir, f"{TMP_PREFIX}deleting-{os.path.basename(path)}")
        os.rename(path, trash)
        fault_point("checkpoint.prune")
        shutil.rmtree(trash)
        logger.info("pruned checkpoint %s", path)
    return doomed


def tidy_save_dir(save_dir: str, keep_last: int) -> None:
    """Finish what a run killed mid-save left in its own `save_dir`: remove the partial (tmp-*) directories and
    prune to `keep_last`. Called when a run (re)starts: a kill during the last save has no later save to do it
    (found by the chaos test: a finished run kept a tmp-deleting-* checkpoint)."""
    if not os.path.isdir(save_dir):
        return
    _remove_stale(save_dir, lambda entry: entry.startswith(TMP_PREFIX))
    prune_checkpoints(save_dir, keep_last)


def _remove_stale(parent: str, is_stale) -> None:
    for entry in os.listdir(parent):
        stale = os.path.join(parent, entry)
        if os.path.isdir(stale) and is_stale(entry):
            logger.warning("removing stale partial checkpoint %s", stale)
            shutil.rmtree(stale)


# ----------------------------------------------------------------------------------------------- atomic files


@contextmanager
def _atomic_dir(path: str, *, clean_all_tmp: bool) -> Iterator[str]:
    """Yield a fresh tmp directory beside `path`; on success it replaces `path` in one rename.

    clean_all_tmp: remove every stale tmp-* directory of the parent (a checkpoint directory we own);
    otherwise only this path's own leftovers (save_hf may write into a directory shared with others).
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if not name or name.startswith(TMP_PREFIX):
        raise ValueError(f"checkpoint path {path!r} must have a name not starting with {TMP_PREFIX!r}")
    os.makedirs(parent, exist_ok=True)
    own = {f"{TMP_PREFIX}{name}", f"{TMP_PREFIX}replaced-{name}"}
    _remove_stale(parent, lambda entry: entry in own or (clean_all_tmp and entry.startswith(TMP_PREFIX)))

    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}")
    os.makedirs(tmp)
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # best effort; a hard crash leaves it to the next save
        raise

    if os.path.exists(path):
        # os.rename cannot replace a non-empty directory: move the old one aside first. A crash between the
        # two renames loses only this name; latest_checkpoint() then falls back to the newest complete one.
        aside = os.path.join(parent, f"{TMP_PREFIX}replaced-{name}")
        os.rename(path, aside)
        os.rename(tmp, path)
        shutil.rmtree(aside)
    else:
        os.rename(tmp, path)
    _fsync(parent)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    _write_text(tmp, text)
    os.replace(tmp, path)
    _fsync(os.path.dirname(path))


def _fsync(path: str) -> None:
    """fsync a file or directory; some filesystems refuse it for directories, which only costs durability."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            _fsync(os.path.join(dirpath, filename))
        _fsync(dirpath)


def _read_trainer_state(path: str) -> dict | None:
    try:
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------- model weights


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module itself under DistributedDataParallel (.module) or torch.compile (._orig_mod)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _write_model(model: torch.nn.Module, tokenizer: Any, directory: str) -> None:
    model = _unwrap(model)
    os.makedirs(directory, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(directory)  # safetensors, tied weights stored once
    else:  # a plain nn.Module: one safetensors file (save_model handles shared tensors)
        from safetensors.torch import save_model

        save_model(model, os.path.join(directory, "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _load_weights(model: torch.nn.Module, directory: str) -> None:
    """Load every *.safetensors of `directory` into `model` in place, strictly.

    In place (not from_pretrained) because the optimizer holds references to these very parameters.
    Keys a file omits are accepted only when they are tied to (share storage with) a loaded tensor.
    """
    from safetensors.torch import load_file

    model = _unwrap(model)
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")) if os.path.isdir(directory) else []
    if not files:
        raise ValueError(f"no *.safetensors weights in {directory!r}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(_read(os.path.join(directory, f), load_file))

    for name, tensor in model.state_dict().items():  # load_state_dict would list every mismatch, at length
        if name in weights and weights[name].shape != tensor.shape:
            raise ValueError(f"{directory}: {name} has shape {tuple(weights[name].shape)} there but "
                             f"{tuple(tensor.shape)} in the model: a checkpoint of another model")
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{directory}: weights not in the model: {sorted(result.unexpected_keys)[:10]}")
    tensors = model.state_dict(keep_vars=True)
    loaded = {tensors[k].data_ptr() for k in weights}
    missing = [k for k in result.missing_keys if tensors[k].data_ptr() not in loaded]
    if missing:
        raise ValueError(f"{directory}: model weights missing from the checkpoint: {sorted(missing)[:10]}")


def _torch_load(path: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _read(path: str, loader: Any) -> Any:
    """loader(path), any failure to read the file (missing, truncated, corrupt) as UnreadableCheckpoint."""
    try:
        return loader(path)
    except Exception as exc:  # noqa: BLE001 - safetensors, zipfile, pickle and OS errors all mean "unreadable"
        first_line = (str(exc).splitlines() or [""])[0][:200]
        raise UnreadableCheckpoint(f"{path} is unreadable ({type(exc).__name__}: {first_line})") from exc
