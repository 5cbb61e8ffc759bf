"""What a run checks at start-up, before anything is built or written: the inputs its config names exist (files,
the model directory, user functions) and the chosen engine can run its KV settings; every output path can be
written. Each failure is one line naming the flag.

Building a config (slime_sparse.config) touches no file and imports no user module; this is where those are
read, once: `check_inputs` by `load_config`, `check_outputs` by the commands before they write.
"""
from __future__ import annotations

import dataclasses
import os

from sglang_patches.settings import check_sglang_kv_config  # pure settings: no SGLang import
from slime_sparse.config import SECTIONS, RunConfig
from slime_sparse.flags import flag_for
from slime_sparse.utils.hf import tokenizer_eos_id
from slime_sparse.utils.paths import check_writable_dir
from slime_sparse.utils.threads import default_threads, model_parameters


class StartupError(ValueError):
    """Bad input met while a run starts (a malformed data row, too few prompts, an output path that cannot be
    written, a checkpoint that does not match the data ...): the commands report it as one line, like a bad flag."""


def check_inputs(cfg: RunConfig) -> RunConfig:
    """`cfg` checked against what it names, with what comes from the model directory filled in: without
    --rollout-stop-token-ids, generation stops at the EOS of --hf-checkpoint's tokenizer; without --threads, the
    threads the model's size calls for (utils/threads.py)."""
    if not cfg.data.prompt_data:
        raise ValueError(f"{flag_for('data', 'prompt_data')} is required: a local jsonl or parquet file of prompts")
    if not cfg.train.hf_checkpoint:
        raise ValueError(f"{flag_for('train', 'hf_checkpoint')} is required: a local Hugging Face model directory")
    for name in SECTIONS:
        section = getattr(cfg, name)
        if hasattr(section, "check_inputs"):
            section.check_inputs()
    if cfg.rollout.engine == "sglang":  # the embedded engine runs every --kv-* setting
        check_sglang_kv_config(cfg.kv)
    if cfg.train.threads is None:  # resolved once, so that config.yaml records what the run used
        threads = default_threads(model_parameters(cfg.train.hf_checkpoint))
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=threads))
    if cfg.sampling.stop_token_ids:
        return cfg
    eos = tokenizer_eos_id(cfg.train.hf_checkpoint)
    if eos is None:
        return cfg
    return dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, stop_token_ids=(eos,)))


def save_dir(cfg: RunConfig) -> str:
    """Where checkpoints go: --save, else <run-dir>/checkpoints."""
    return cfg.train.save or os.path.join(cfg.log.run_dir, "checkpoints")


def check_outputs(cfg: RunConfig) -> None:
    """The run directory and the checkpoint directory can be written (nothing is created here)."""
    try:
        check_writable_dir(cfg.log.run_dir, flag_for("log", "run_dir"))
        check_writable_dir(save_dir(cfg), flag_for("train", "save") if cfg.train.save else flag_for("log", "run_dir"))
    except ValueError as exc:
        raise StartupError(str(exc)) from None
