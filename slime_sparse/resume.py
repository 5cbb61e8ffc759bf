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

from slime_sparse.config import RunConfig
from slime_sparse.flags import flag_for
from slime_sparse.utils.checkpoint import checkpoint_to_resume, list_checkpoints

# sections compared whole (but for schedule fields in them), and single fields of other sections
EXPERIMENT_SECTIONS = ("data", "sampling", "kv", "loss", "correction")
EXPERIMENT_FIELDS = (("train", "hf_checkpoint"),)
SCHEDULE_FIELDS = (("data", "num_epochs"),)  # more epochs for more rollouts: the prompt order stays the same
# labels derived from the fields that are compared (the correction's knobs, whatever preset they started from)
DERIVED_FIELDS = (("correction", "preset"), ("kv", "preset"))
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
