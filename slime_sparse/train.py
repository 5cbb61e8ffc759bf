"""The Sparse-RL training loop: one loop for every combination of rollout engine and learner backend.

rollout function (prompts -> n samples each under compressed KV -> rewards -> pi_old -> dynamic-sampling filters,
`--rollout-function-path`) -> group advantages -> pi_ref -> sparsity correction -> optimizer steps -> weight sync
-> metrics -> eval / checkpoint.

    slime-sparse-train --hf-checkpoint MODEL_DIR --prompt-data train.jsonl --kv-method rkv --kv-budget 512 ...
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import contextmanager
from typing import Iterator

from slime_sparse.async_loop import async_loop
from slime_sparse.components import Components, build_components
from slime_sparse.config import RunConfig
from slime_sparse.config_loader import load_config, save_config
from slime_sparse.eval import evaluate_modes
from slime_sparse.flags import flag_for
from slime_sparse.preflight import start_warnings, warn
from slime_sparse.resume import CONFIG_KEY, check_experiment, resume, resume_candidates
from slime_sparse.reward import RewardFailure
from slime_sparse.run import (Run, Stop, is_due, read_summary, run_rollout, start_guard, train_rollout,
                              write_summary)
from slime_sparse.startup import StartupError, check_outputs, save_dir
from slime_sparse.utils.checkpoint import read_trainer_state, tidy_save_dir
from slime_sparse.utils.seed import set_seed
from slime_sparse.utils.threads import torch_threads

logger = logging.getLogger("slime_sparse.train")


def train(cfg: RunConfig, stop: Stop | None = None) -> dict:
    """Run (or resume) training; returns a summary (first/last metrics and evaluations, status).

    Nothing is written before every start-up check has passed (output paths, config, data, model, checkpoint),
    so a failed rerun leaves a run as it was; rerunning a complete run changes nothing. A stop (SIGINT, SIGTERM)
    saves the last finished rollout, so that a rerun resumes from it."""
    stop = stop or Stop()
    check_outputs(cfg)
    checkpoints = save_dir(cfg)
    candidates = resume_candidates(cfg.train.load or checkpoints)  # --load, else the run's own checkpoints
    if candidates:
        state = read_trainer_state(candidates[0])
        check_experiment(cfg, candidates[0], state["extra"].get(CONFIG_KEY))
        if state["step"] >= cfg.train.num_rollout:
            print(f"{cfg.log.run_dir}: the run is complete ({candidates[0]} is rollout {state['step']}, "
                  f"{flag_for('train', 'num_rollout')} is {cfg.train.num_rollout}): nothing to do; raise "
                  f"{flag_for('train', 'num_rollout')} to extend it", file=sys.stderr)
            tidy_save_dir(checkpoints, cfg.train.keep_last)  # only what a kill mid-save left (none after a clean end)
            return read_summary(cfg.log.run_dir)
    set_seed(cfg.train.seed)
    try:
        components = build_components(cfg)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    try:
        start, resumed_from = resume(components, candidates)
        # only now, the data, model and checkpoint read: a start-up error is the one line a failed start prints
        print(f"run directory: {cfg.log.run_dir} (config.yaml, metrics.jsonl, summary.json); checkpoints: "
              f"{checkpoints}", file=sys.stderr, flush=True)
        for line in start_warnings(cfg, max(len(p.prompt_ids) for p in components.stream.dataset.prompts)):
            warn(line)
        guard = start_guard(cfg, components, resumed_from)
        tidy_save_dir(checkpoints, cfg.train.keep_last)
        os.makedirs(cfg.log.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.log.run_dir, "config.yaml"))
        run = Run(cfg, start, resumed_from, guard)
        try:
            loop(cfg, components, run, stop)
        except KeyboardInterrupt as exc:  # SIGINT / SIGTERM: save the last finished rollout, stop the workers
            run.save_on_stop(components, str(exc) or "SIGINT")
            write_summary(cfg.log.run_dir, run.summary)
            exc.reported = True
            raise
        finally:
            run.log.close()
    finally:
        components.close()
    write_summary(cfg.log.run_dir, run.summary)
    return run.summary


def loop(cfg: RunConfig, components: Components, run: Run, stop: Stop) -> None:
    """Rollouts from `run.start` to --num-rollout, evaluating and saving as due (--async: async_loop.py)."""
    if cfg.overlap.async_train:
        return async_loop(cfg, components, run, stop)
    if run.start == 0 and components.eval_sets:
        run.summary["evals"][0] = evaluate_modes(cfg, components, step=0, logger=run.log)
        write_summary(cfg.log.run_dir, run.summary)  # an evaluation is in summary.json as soon as it is done
    progress = components.progress(range(run.start, cfg.train.num_rollout), desc="rollouts", initial=run.start)
    for rollout_id in progress:
        step = rollout_id + 1
        guard = run.guard  # the drift probe runs before the rollout, on the weights that generate it
        drift = guard.probe(components, rollout_id) if guard is not None and guard.due(rollout_id) else {}
        prepared, metrics = run_rollout(cfg, components, rollout_id)  # a stop here saves the last finished one
        metrics.update(drift)
        with stop.deferred():  # from the first optimizer step to the metrics line, a stop waits
            metrics = train_rollout(cfg, components, prepared, metrics)
            if guard is not None:
                metrics.update(guard.account(metrics))
            run.finished(step, metrics, components.data_state())
            components.policy_version = step  # train_rollout synced the engine
        progress.set_postfix(reward=f"{metrics.get('rollout/reward_mean', 0.0):.3f}",
                             kv_save=f"{metrics.get('kv/savings', 0.0):.2f}",
                             rej=f"{metrics.get('correction/seq_reject_rate', 0.0):.3f}",
                             groups=f"{metrics.get('rollout/groups_kept', 0):.0f}/"
                                    f"{metrics.get('rollout/groups_generated', 0):.0f}",
                             rm_fail=int(metrics.get("reward/errors", 0) + metrics.get("reward/timeouts", 0)))
        if components.eval_sets and is_due(step, cfg.train.eval_interval, cfg.train.num_rollout):
            run.summary["evals"][step] = evaluate_modes(cfg, components, step=step, logger=run.log)
            write_summary(cfg.log.run_dir, run.summary)
        if is_due(step, cfg.train.save_interval, cfg.train.num_rollout):
            with stop.deferred():
                run.save(components, step)
    run.summary["status"] = "complete"


@contextmanager
def signals_interrupt() -> Iterator[Stop]:
    """SIGTERM and SIGINT go to a Stop (see there) for the duration; the previous handlers come back after."""
    stop = Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
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
        with signals_interrupt() as stop, torch_threads(cfg.train.threads):
            train(cfg, stop)
    except StartupError as exc:
        logger.debug("start-up failed", exc_info=True)  # the traceback, at DEBUG level
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RewardFailure as exc:  # the message carries the grader's traceback; ours would add nothing
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        code = getattr(exc, "exit_code", 128 + signal.SIGINT)
        if not getattr(exc, "reported", False):  # stopped while starting: train() had nothing to save
            print(f"{signal.Signals(code - 128).name}: stopped while the run was starting, before a rollout; rerun "
                  "the command to start it again", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
