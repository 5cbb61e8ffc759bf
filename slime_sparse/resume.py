"""What a rerun of a training command finds in its run: the checkpoints it may resume (newest first), and
whether the experiment they were trained under is the one asked for now.

A checkpoint records the run config it was saved under (trainer_state.json, extra.config). Resuming under other
experiment fields (the model, data, sampling, KV compression, loss, correction) would splice two experiments into
one curve, so it is refused unless `--allow-config-change`; the schedule and logging (--num-rollout, intervals,
progress, W&B ...) may change freely.
"""
from __future__ import annotations

import json
from typing import Any

import logging

from slime_sparse.config import RunConfig
from slime_sparse.flags import flag_for
from slime_sparse.preflight import warn
from slime_sparse.startup import StartupError
from slime_sparse.utils.checkpoint import UnreadableCheckpoint, checkpoint_to_resume, list_checkpoints

logger = logging.getLogger("slime_sparse.train")

# sections compared whole (but for schedule fields in them), and single fields of other sections
EXPERIMENT_SECTIONS = ("data", "sampling", "kv", "loss", "correction")
EXPERIMENT_FIELDS = (("train", "hf_checkpoint"), ("rollout", "advantage_estimator"),
                     ("rollout", "grpo_std_normalization"), ("rollout", "normalize_advantages"))
SCHEDULE_FIELDS = (("data", "num_epochs"),)  # more epochs for more rollouts: the prompt order stays the same
# labels derived from the fields that are compared (the correction's knobs, whatever preset they started from; the
# loss's ratio level, from --advantage-estimator)
DERIVED_FIELDS = (("correction", "preset"), ("kv", "preset"), ("loss", "ratio_level"), ("loss", "policy_loss_mode"))
CONFIG_KEY = "config"  # where Components.save_checkpoint puts the run config in a checkpoint's `extra`


def checkpoint_config(cfg: RunConfig) -> dict[str, Any]:
    """The run config as a checkpoint stores it (JSON values: tuples become lists)."""
    return json.loads(json.dumps(cfg.to_dict()))


def resume_candidates(path: str) -> list[str]:
    """The checkpoints `--load PATH` may resume, the one to try first first: PATH itself when it is a checkpoint
    (the user named it: nothing else), else the one `latest` names and then the older complete ones."""
    first = checkpoint_to_resume(path)
    if first is None or first == path:
        return [first] if first else []
    return [first] + [p for _, p in reversed(list_checkpoints(path)) if p != first]


def experiment_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """`--flag old -> new` for each experiment field that differs between a checkpoint's config (`saved`; None: a
    checkpoint that recorded none, nothing to compare) and the current one (both as `checkpoint_config` makes)."""
    if saved is None:
        return []
    keys = [(s, name) for s in EXPERIMENT_SECTIONS for name in current.get(s, {})
            if (s, name) not in SCHEDULE_FIELDS + DERIVED_FIELDS]
    keys += list(EXPERIMENT_FIELDS)
    defaults = checkpoint_config(RunConfig())
    changes = []
    for section, name in keys:
        # a field the checkpoint's version did not have yet ran at its default (every new knob's default is the
        # behaviour from before it existed)
        old = saved.get(section, {}).get(name, defaults.get(section, {}).get(name))
        new = current.get(section, {}).get(name)
        if old != new:
            changes.append(f"{flag_for(section, name)} {_show(old)} -> {_show(new)}")
    return changes


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "unset"
    return "unset" if value in (None, "") else str(value)


def check_experiment(cfg: RunConfig, checkpoint: str, saved: dict | None) -> None:
    """Refuse (one line) to resume `checkpoint` under other experiment fields, unless --allow-config-change."""
    changes = experiment_changes(saved, checkpoint_config(cfg))
    if not changes:
        return
    if cfg.train.allow_config_change:
        warn(f"resuming {checkpoint} with a changed experiment ({'; '.join(changes)}): "
             f"{flag_for('train', 'allow_config_change')} is given")
        return
    raise StartupError(f"{checkpoint} was trained with other settings: {'; '.join(changes)}. Rerun with its settings, "
                       f"start a new {flag_for('log', 'run_dir')}, or pass {flag_for('train', 'allow_config_change')}")


def resume(components, candidates: list[str]) -> tuple[int, str | None]:
    """Load the first readable checkpoint of `candidates` (newest first) into the run's `components`: its rollout
    and path, or (0, None)
    without one. An unreadable one (truncated or corrupt files) is skipped with a warning; any other mismatch
    stops the run."""
    for i, path in enumerate(candidates):
        try:
            start = components.load_checkpoint(path)
        except UnreadableCheckpoint as exc:
            if i + 1 < len(candidates):
                warn(f"{exc}: resuming from the previous checkpoint, {candidates[i + 1]}")
                continue
            raise StartupError(f"cannot resume: {exc}") from exc
        except ValueError as exc:
            raise StartupError(f"cannot resume from {path}: {exc}") from exc
        logger.info("resumed from %s at rollout %d", path, start)
        return start, path
    return 0, None
