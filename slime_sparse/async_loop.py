"""The loop of --async (slime's train_async.py; the entry point is slime_sparse/train_async.py, whose docstring
says what it does): rollout k + 1 generates on a thread while the learner trains on rollout k."""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

import torch

from slime_sparse.algo import mismatch_staleness_metrics
from slime_sparse.backends.logprobs import pad_right, response_logprobs, response_mask
from slime_sparse.config import RunConfig
from slime_sparse.components import Components
from slime_sparse.eval import evaluate_modes
from slime_sparse.rollout.base_types import RolloutFnTrainOutput, call_rollout_fn
from slime_sparse.run import Run, Stop, is_due, prepare_batch, train_rollout
from slime_sparse.types import Sample

SAMPLES_FILE = "samples.jsonl"


class RolloutSource:
    """The run's components as a rollout function sees them under --async: all but the learner, which trains
    meanwhile (a custom --rollout-function-path that reads it gets an error saying so)."""

    def __init__(self, components: Components) -> None:
        self._components = components

    def __getattr__(self, name: str):
        if name == "learner":
            raise RuntimeError("--async: the rollout function runs while the learner trains on the previous rollout; "
                               "it may not use data_source.learner (pi_old is recomputed when the rollout is trained)")
        return getattr(self._components, name)


@dataclass
class Produced:
    rollout_id: int
    output: RolloutFnTrainOutput
    data_state: dict  # the data position right after it (what a checkpoint of the step that trains it stores)
    seconds: float
    # per sample, the dense log-probs under the weights that sampled it (where this process holds them), or None
    then: list | None = None


def sampler_version_logprobs(cfg: RunConfig, components: Components, output: RolloutFnTrainOutput) -> list | None:
    """Dense log-probs of the rollout's samples under the weights that sampled them, computed beside the learner
    before the engines are updated: what mismatch/staleness/* compares pi_old with. Only where this process holds
    those weights (the in-process embedded engine's model; not on Ray or SGLang, where the staleness stays folded
    into mismatch/numeric/*), only when the mismatch diagnostics are due, and only for samples written by the
    engines' current weights alone (a continued sample's earlier stretches came from older ones: None)."""
    model = getattr(components.engine, "model", None)
    plan = output.plan or cfg.rollout_plan(0)
    if not isinstance(model, torch.nn.Module) or not plan.metrics_due or cfg.loss.trains_shadow \
            or cfg.correction.bypass_mode:
        return None
    samples = [s for group in output.samples for s in group]
    now = components.policy_version
    out: list = []
    with torch.inference_mode():
        for i in range(0, len(samples), 16):  # bounded memory: 16 samples per forward
            part = samples[i:i + 16]
            logp, _ = response_logprobs(model, [s.prompt_ids + s.response_ids for s in part],
                                        [len(s.response_ids) for s in part], temperature=cfg.sampling.temperature,
                                        fp32_lm_head=cfg.train.enable_fp32_lm_head)
            out += [row[:len(s.response_ids)].float() if [v for _, v in s.segments] == [now] else None
                    for row, s in zip(logp, part)]
    return out


class Producer:
    """One rollout at a time on a background thread (a daemon: a stopped run does not wait for it)."""

    def __init__(self, cfg: RunConfig, components: Components) -> None:
        self.cfg, self.components = cfg, components
        self.source = RolloutSource(components)
        self._thread: threading.Thread | None = None
        self._box: dict = {}

    def submit(self, rollout_id: int) -> None:
        if self._thread is not None:
            raise RuntimeError("a rollout is already generating")
        self._box = {}

        def work() -> None:
            t0 = time.perf_counter()
            try:
                output = call_rollout_fn(self.components.rollout_fn, self.cfg, rollout_id, self.source)
                state, seconds = self.components.data_state(), time.perf_counter() - t0
                then = sampler_version_logprobs(self.cfg, self.components, output)
                self._box["done"] = Produced(rollout_id, output, state, seconds, then)
            except BaseException as exc:  # noqa: BLE001 - raised again in the main thread by take()
                self._box["error"] = exc

        self._thread = threading.Thread(target=work, name=f"rollout-{rollout_id}", daemon=True)
        self._thread.start()

    def drain(self) -> float:
        """Wait for the rollout generating now (if any) to finish; the seconds waited."""
        t0 = time.perf_counter()
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=0.5)  # in slices: a signal still reaches the main thread
        return time.perf_counter() - t0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def take(self, rollout_id: int) -> Produced:
        self.drain()
        self._thread = None
        if "error" in self._box:
            raise self._box["error"]
        produced = self._box["done"]
        if produced.rollout_id != rollout_id:
            raise RuntimeError(f"expected rollout {rollout_id}, the producer made {produced.rollout_id}")
        return produced


def trained_versions(sample: Sample, mask_offpolicy: bool) -> list[int]:
    """Policy versions of the stretches of `sample` that carry a gradient."""
    versions = [v for _, v in sample.segments]
    return versions[-1:] if mask_offpolicy else versions


def staleness_metrics(staleness: list[int], bound: int | None) -> dict[str, float]:
    out = {"rollout/staleness_mean": sum(staleness) / len(staleness), "rollout/staleness_max": float(max(staleness)),
           "rollout/staleness_min": float(min(staleness))}
    for k in range(max(staleness) + 1 if bound is None else bound + 1):
        out[f"rollout/staleness_frac_{k}"] = sum(s == k for s in staleness) / len(staleness)
    return out


class SampleLedger:
    """<run-dir>/samples.jsonl: one line per trained sample (step, prompt, staleness, the versions that wrote it).
    Like metrics.jsonl, a resumed run first drops the lines of the steps it redoes."""

    def __init__(self, run_dir: str, start_step: int) -> None:
        self.path = os.path.join(run_dir, SAMPLES_FILE)
        kept = []
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        if json.loads(line)["step"] < start_step:
                            kept.append(line)
                    except (ValueError, KeyError):
                        break  # a line cut by a kill: nothing after it was written whole
        with open(f"{self.path}.tmp", "w", encoding="utf-8") as fh:
            fh.writelines(kept)
        os.replace(f"{self.path}.tmp", self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, samples: list[Sample], staleness: list[int]) -> None:
        for j, (s, k) in enumerate(zip(samples, staleness)):
            self._file.write(json.dumps({"step": step, "prompt_index": s.prompt_index, "sample": j, "staleness": k,
                                         "segments": [list(x) for x in s.segments],
                                         "response_len": len(s.response_ids), "finish_reason": s.finish_reason})
                             + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def take_batch(cfg: RunConfig, components: Components, produced: Produced, rollout_id: int):
    """Rollout `rollout_id` made a batch with the learner's weights now; its samples and their staleness."""
    samples = [s for group in produced.output.samples for s in group]
    mask = cfg.overlap.mask_offpolicy_in_partial_rollout
    staleness = [rollout_id - min(trained_versions(s, mask), default=rollout_id) for s in samples]
    bound = cfg.overlap.max_staleness
    if bound is not None and staleness and max(staleness) > bound:  # the schedule and partial_round rule it out
        raise RuntimeError(f"rollout {rollout_id}: a sample is {max(staleness)} versions old, over --max-staleness "
                           f"{bound}")
    first = staleness_metrics(staleness, bound) if staleness else {}
    prepared, metrics = prepare_batch(cfg, components, produced.output, first)
    if prepared is not None and produced.then is not None and any(t is not None for t in produced.then):
        lens = prepared.batch.response_lens
        then = pad_right([t if t is not None else torch.zeros(n) for t, n in zip(produced.then, lens)], 0.0,
                         dtype=torch.float32)
        mask = response_mask(lens) * torch.tensor([[t is not None] for t in produced.then], dtype=torch.float32)
        metrics.update(mismatch_staleness_metrics(pad_right(prepared.batch.old_logprobs, 0.0, dtype=torch.float32),
                                                  then, mask, **cfg.correction.diagnostic_bounds()))
    return prepared, metrics, samples, staleness


def async_loop(cfg: RunConfig, components: Components, run: Run, stop: Stop) -> None:
    """Rollouts from `run.start` to --num-rollout, each generated while the learner trains on the one before."""
    last, interval = cfg.train.num_rollout, cfg.overlap.update_weights_interval
    if run.start == 0 and components.eval_sets:
        run.summary["evals"][0] = evaluate_modes(cfg, components, step=0, logger=run.log)
    components.policy_version = run.start  # the engines hold the learner's weights (the start-up sync)
    producer = Producer(cfg, components)
    ledger = SampleLedger(cfg.log.run_dir, start_step=run.start + 1)
    producer.submit(run.start)
    guard, probe_due = run.guard, False  # the drift guard probes when the engines are drained for an update
    try:
        progress = components.progress(range(run.start, last), desc="rollouts (async)", initial=run.start)
        for rollout_id in progress:
            step, t_step = rollout_id + 1, time.perf_counter()
            probe_due = probe_due or (guard is not None and guard.due(rollout_id))
            t0 = time.perf_counter()
            produced = producer.take(rollout_id)
            waited = time.perf_counter() - t0
            if step < last:
                producer.submit(rollout_id + 1)  # on the engines as they are: weights of `policy_version`
            prepared, metrics, samples, staleness = take_batch(cfg, components, produced, rollout_id)
            evaluate = bool(components.eval_sets) and is_due(step, cfg.train.eval_interval, last)
            with stop.deferred():  # from the first optimizer step to the metrics line, a stop waits
                metrics = train_rollout(cfg, components, prepared, metrics, sync=False)
                if step % interval == 0 or evaluate or step == last:
                    metrics["perf/drain_s"] = producer.drain()  # no weight update mid-generation
                    t1 = time.perf_counter()
                    components.sync_weights()
                    components.policy_version = step
                    metrics["perf/sync_s"] = time.perf_counter() - t1
                    if probe_due:  # idle engines with the learner's weights: those of the next rollout submitted
                        metrics.update(guard.probe(components, step))
                        probe_due = False
                if guard is not None:
                    metrics.update(guard.account(metrics))
                metrics.update({"rollout/weight_version": float(components.engine.weight_version),
                                "rollout/policy_version": float(components.policy_version),
                                "perf/wait_rollout_s": waited, "perf/rollout_wall_s": produced.seconds,
                                "perf/step_s": time.perf_counter() - t_step})
                run.finished(step, metrics, produced.data_state)
                ledger.write(step, samples, staleness)
            progress.set_postfix(reward=f"{metrics.get('rollout/reward_mean', 0.0):.3f}",
                                 stale=f"{metrics.get('rollout/staleness_mean', 0.0):.2f}",
                                 wait=f"{waited:.1f}s")
            if evaluate:  # the engines are drained and hold the learner's weights
                run.summary["evals"][step] = evaluate_modes(cfg, components, step=step, logger=run.log)
            if is_due(step, cfg.train.save_interval, last):
                with stop.deferred():
                    run.save(components, step, produced.data_state)
        run.summary["status"] = "complete"
    finally:
        ledger.close()
