"""The Sparse-RL training loop: one loop for every combination of rollout engine and learner backend.

rollout (n samples per prompt, compressed KV) -> reward -> dense recompute of pi_old -> dynamic-sampling
filters (more rounds until the batch is full) -> group advantages -> pi_ref -> sparsity correction -> optimizer
steps -> weight sync -> metrics -> eval/checkpoint.

    slime-sparse-train --hf-checkpoint MODEL_DIR --prompt-data train.jsonl --kv-method rkv --kv-budget 512 ...
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from slime_sparse.algo import crossed_alarms
from slime_sparse.backends.metrics import mean_over_steps
from slime_sparse.components import Components, build_components
from slime_sparse.config import LogConfig, RunConfig
from slime_sparse.config_loader import load_config, save_config
from slime_sparse.eval import evaluate_modes
from slime_sparse.flags import flag_for
from slime_sparse.pipeline import (assign_rewards, dense_logprobs, prepare_rollout, response_metrics, split_steps,
                                   to_samples)
from slime_sparse.preflight import no_gradient_warning, start_warnings, warn
from slime_sparse.resume import CONFIG_KEY, checkpoint_config, experiment_changes, resume_candidates
from slime_sparse.reward import RewardFailure
from slime_sparse.rollout.filter_hub import load_filters, round_size, select_groups
from slime_sparse.rollout.sampling import derive_seed
from slime_sparse.types import Sample
from slime_sparse.utils.checkpoint import UnreadableCheckpoint, read_trainer_state, tidy_save_dir
from slime_sparse.utils.logging import MetricsLogger, WandbSettings
from slime_sparse.utils.seed import set_seed

logger = logging.getLogger("slime_sparse.train")
SUMMARY_FILE = "summary.json"


class StartupError(ValueError):
    """Bad input met while a run starts (a malformed data row, too few prompts, a checkpoint that does not
    match the data ...): main() reports it as one line, like a bad flag."""


def rollout_seed(cfg: RunConfig, rollout_id: int, round_id: int = 0) -> int:
    """Sampling seed of one generation round of a rollout: a pure function of (seed, rollout id, round), so a
    resumed run draws the same. Round 0 (the only one without dynamic sampling) keeps the plain formula."""
    seed = cfg.train.seed * 1_000_003 + rollout_id
    return seed if round_id == 0 else derive_seed(seed, -round_id)


def is_due(step: int, interval: int, last_step: int) -> bool:
    """The cadence of periodic actions (evaluation, checkpoints): after every `interval` rollouts (0: none in
    between) and after the last one."""
    return step == last_step or (interval > 0 and step % interval == 0)


def wandb_settings(log: LogConfig) -> WandbSettings:
    return WandbSettings(project=log.wandb_project, entity=log.wandb_team, group=log.wandb_group,
                         name=log.wandb_run_name, mode=log.wandb_mode, host=log.wandb_host)


@dataclass
class GeneratedRollout:
    """The train batch's samples (whole groups, in stream order) with their pi_old, and the metrics of generating
    them: rollout/* over every generated sample, dynamic sampling's counts, timings."""

    samples: list[Sample] = field(default_factory=list)
    old_logprobs: list[torch.Tensor] | None = field(default_factory=list)  # None: not computed (bypass)
    metrics: dict[str, float] = field(default_factory=dict)


def mismatch_metrics_due(cfg: RunConfig, rollout_id: int) -> bool:
    """Whether rollout `rollout_id` (0-based) computes the mismatch diagnostics that cost an extra forward: every
    --mismatch-metrics-interval rollouts from the first (0: never)."""
    interval = cfg.log.mismatch_metrics_interval
    return interval > 0 and rollout_id % interval == 0


def generate_rollout(cfg: RunConfig, components: Components, rollout_id: int) -> GeneratedRollout:
    """Generation rounds until the batch holds --rollout-batch-size groups that pass --dynamic-sampling-filter-path
    (slime's dynamic sampling, DAPO), at most --dynamic-sampling-max-rounds of them. A round draws prompts
    (`round_size`: --over-sampling-batch-size first), generates, scores, recomputes pi_old (the filters see which
    samples the correction rejects) and judges its groups in stream order; the groups after the last one the batch
    needed go back to the prompt stream, so every prompt is trained on or dropped (counted) exactly once."""
    n, target = cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size
    filters = load_filters(cfg.rollout.dynamic_sampling_filter_path)
    out = GeneratedRollout()
    generated: list[Sample] = []
    counts: Counter = Counter()
    t_rollout = t_recompute = 0.0
    for round_id in range(cfg.rollout.dynamic_sampling_max_rounds):
        kept = len(out.samples) // n
        size = round_size(cfg.rollout.sampling_batch_size, need=target - kept, kept=kept,
                          judged=kept + counts["rollout/groups_dropped"])
        records = components.stream.next_batch(size)
        t0 = time.perf_counter()
        outputs = components.engine.generate([r.prompt_ids for r in records for _ in range(n)], cfg.sampling,
                                             seed=rollout_seed(cfg, rollout_id, round_id))
        t_rollout += time.perf_counter() - t0
        samples = to_samples(records, outputs, n)
        counts.update(assign_rewards(samples, components.tokenizer, components.reward_fn))
        t1 = time.perf_counter()
        old = dense_logprobs(samples, components.learner, cfg.correction, trains_shadow=cfg.loss.trains_shadow,
                             metrics_due=mismatch_metrics_due(cfg, rollout_id) or cfg.loss.trains_shadow)
        t_recompute += time.perf_counter() - t1

        groups = [samples[i:i + n] for i in range(0, len(samples), n)]
        selection = select_groups(groups, filters, cfg, target - len(out.samples) // n)
        components.stream.put_back(len(groups) - selection.judged)
        keep = [g * n + j for g in selection.kept for j in range(n)]
        out.samples += [samples[i] for i in keep]
        out.old_logprobs = None if old is None else out.old_logprobs + [old[i] for i in keep]
        generated += samples
        counts.update({"rollout/groups_generated": len(groups), "rollout/groups_put_back": len(groups) - selection.judged,
                       "rollout/groups_dropped": sum(selection.dropped.values()), "rollout/gen_rounds": 1,
                       **{f"rollout/dynamic_filter/drop_{k}": v for k, v in selection.dropped.items()}})
        if len(out.samples) == target * n:
            break
    else:
        logger.warning("rollout %d: dynamic sampling kept %d of --rollout-batch-size=%d groups in "
                       "--dynamic-sampling-max-rounds=%d rounds; training on those", rollout_id,
                       len(out.samples) // n, target, cfg.rollout.dynamic_sampling_max_rounds)
    gen_tokens = sum(len(s.response_ids) for s in generated)
    train_tokens = sum(len(s.response_ids) for s in out.samples)
    out.metrics = {
        **response_metrics(generated), **{k: float(v) for k, v in counts.items()},
        "rollout/groups_kept": len(out.samples) / n,
        "rollout/dynamic_sampling_exhausted": float(len(out.samples) < target * n),
        "rollout/gen_tokens": float(gen_tokens),
        "rollout/gen_tokens_per_train_token": gen_tokens / max(train_tokens, 1),
        "perf/rollout_s": t_rollout, "perf/recompute_s": t_recompute,
        "perf/rollout_tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
    }
    return out


def run_rollout(cfg: RunConfig, components: Components, rollout_id: int) -> dict[str, float]:
    rollout = generate_rollout(cfg, components, rollout_id)
    metrics = rollout.metrics
    per_step = []
    t_train = 0.0
    if rollout.samples:  # dynamic sampling may keep no group at all (counted above): then no optimizer step
        t1 = time.perf_counter()
        prepared = prepare_rollout(rollout.samples, components.learner, cfg.correction, old=rollout.old_logprobs,
                                   normalize_std=cfg.rollout.grpo_std_normalization, need_ref=cfg.loss.needs_ref,
                                   trains_shadow=cfg.loss.trains_shadow,
                                   metrics_due=mismatch_metrics_due(cfg, rollout_id))
        metrics["perf/recompute_s"] += time.perf_counter() - t1
        metrics.update(prepared.metrics)
        t2 = time.perf_counter()
        per_step = [components.learner.train_step(part) for part in split_steps(prepared.batch, cfg.steps_per_rollout)]
        t_train = time.perf_counter() - t2
    metrics.update(mean_over_steps(per_step))

    t3 = time.perf_counter()
    components.sync_weights()
    t_sync = time.perf_counter() - t3

    metrics.update({
        "perf/train_s": t_train, "perf/sync_s": t_sync,
        "rollout/weight_version": float(components.engine.weight_version),
    })
    return metrics


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT: Ctrl-C) arrived; `exit_code` is the shell's 128 + signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def train(cfg: RunConfig) -> dict:
    """Run (or resume) training; returns a summary (first/last metrics and evaluations, status).

    Nothing is written into the run directory before every start-up check has passed (config, data, model,
    checkpoint), so a failed rerun leaves a run as it was; rerunning a complete run changes nothing."""
    save_dir = cfg.train.save or os.path.join(cfg.log.run_dir, "checkpoints")
    candidates = resume_candidates(cfg.train.load or save_dir)  # --load, else the run's own checkpoints
    if candidates:
        state = read_trainer_state(candidates[0])
        check_experiment(cfg, candidates[0], state["extra"].get(CONFIG_KEY))
        if state["step"] >= cfg.train.num_rollout:
            print(f"{cfg.log.run_dir}: the run is complete ({candidates[0]} is rollout {state['step']}, "
                  f"{flag_for('train', 'num_rollout')} is {cfg.train.num_rollout}): nothing to do; raise "
                  f"{flag_for('train', 'num_rollout')} to extend it", file=sys.stderr)
            tidy_save_dir(save_dir, cfg.train.keep_last)  # only what a kill mid-save left (none after a clean end)
            return read_summary(cfg.log.run_dir)
    set_seed(cfg.train.seed)
    try:
        components = build_components(cfg)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    start = resume(components, candidates)
    for line in start_warnings(cfg, max(len(p.prompt_ids) for p in components.stream.dataset.prompts)):
        warn(line)
    tidy_save_dir(save_dir, cfg.train.keep_last)
    os.makedirs(cfg.log.run_dir, exist_ok=True)
    save_config(cfg, os.path.join(cfg.log.run_dir, "config.yaml"))
    metrics_log = MetricsLogger(cfg.log.run_dir, use_tensorboard=cfg.log.use_tensorboard,
                                wandb=wandb_settings(cfg.log) if cfg.log.use_wandb else None, config=cfg.to_dict(),
                                start_step=start + 1 if start else 0)  # drop lines logged after the checkpoint
    summary: dict = {"status": "interrupted", "last_rollout": start, "evals": {}}
    no_gradient_warned = False
    alarmed: set[str] = set()  # mismatch alarms already shown
    try:
        if start == 0 and components.eval_sets:
            summary["evals"][0] = evaluate_modes(cfg, components, step=0, logger=metrics_log)
        progress = components.progress(range(start, cfg.train.num_rollout), desc="rollouts", initial=start)
        for rollout_id in progress:
            metrics = run_rollout(cfg, components, rollout_id)
            step = rollout_id + 1
            metrics_log.log(step, metrics)
            if not no_gradient_warned and (line := no_gradient_warning(step, metrics)):
                warn(line)
                no_gradient_warned = True
            for key, line in crossed_alarms(metrics):
                if key not in alarmed:
                    warn(f"rollout {step}: {line}; see the metrics list in README.md (each alarm shown once per run)")
                    alarmed.add(key)
            if rollout_id == start:
                summary["first"] = metrics
            summary["last"], summary["last_rollout"] = metrics, step
            progress.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}",
                                 kv_save=f"{metrics.get('kv/savings', 0.0):.2f}",
                                 rej=f"{metrics.get('correction/seq_reject_rate', 0.0):.3f}",
                                 groups=f"{metrics['rollout/groups_kept']:.0f}/{metrics['rollout/groups_generated']:.0f}",
                                 rm_fail=int(metrics.get("reward/errors", 0) + metrics.get("reward/timeouts", 0)))
            if components.eval_sets and is_due(step, cfg.train.eval_interval, cfg.train.num_rollout):
                summary["evals"][step] = evaluate_modes(cfg, components, step=step, logger=metrics_log)
            if is_due(step, cfg.train.save_interval, cfg.train.num_rollout):
                components.save_checkpoint(save_dir, step)
        summary["status"] = "complete"
    except KeyboardInterrupt:  # SIGINT / SIGTERM: stop the workers, flush the metrics, say where the run stopped
        write_summary(cfg.log.run_dir, summary)
        raise
    finally:
        metrics_log.close()
        components.close()
    write_summary(cfg.log.run_dir, summary)
    return summary


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


def resume(components: Components, candidates: list[str]) -> int:
    """Load the first readable checkpoint of `candidates` (newest first); its rollout, or 0 without one. An
    unreadable one (truncated or corrupt files) is skipped with a warning; any other mismatch stops the run."""
    for i, path in enumerate(candidates):
        try:
            start = components.load_checkpoint(path)
        except UnreadableCheckpoint as exc:
            if i + 1 < len(candidates):
                warn(f"{exc}: resuming from the previous checkpoint, {candidates[i + 1]}")
                continue
            components.close()
            raise StartupError(f"cannot resume: {exc}") from exc
        except ValueError as exc:
            components.close()
            raise StartupError(f"cannot resume from {path}: {exc}") from exc
        logger.info("resumed from %s at rollout %d", path, start)
        return start
    return 0


def read_summary(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, SUMMARY_FILE), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def write_summary(run_dir: str, summary: dict) -> None:
    path = os.path.join(run_dir, SUMMARY_FILE)
    with open(f"{path}.tmp", "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2, default=float)
    os.replace(f"{path}.tmp", path)  # a kill mid-write leaves the previous summary, not half of one


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGINT raise Interrupted in the main thread, so the loop unwinds through its cleanup; a second
    signal during that cleanup exits at once."""
    def first(signum: int, _frame) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda n, _f: os._exit(128 + n))
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, first) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with signals_interrupt():
            train(cfg)
    except StartupError as exc:
        logger.debug("start-up failed", exc_info=True)  # the traceback, at DEBUG level
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RewardFailure as exc:  # the message carries the grader's traceback; ours would add nothing
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        code = getattr(exc, "exit_code", 128 + signal.SIGINT)
        print(f"interrupted ({signal.Signals(code - 128).name}); rerun the command to resume from the last "
              "checkpoint", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
