"""The drift guard in a run: the probe the training loop calls, its warning, and the budget that adapts.

Every --drift-probe-interval rollouts (the first included), before the rollout is generated, the current policy
answers the probe prompts (held out: never training prompts) with the rollout's sampling settings twice, from the
same random streams (one seed for both arms, sample i drawing from the stream of (seed, i)): densely and under the
KV settings rollouts use now. `drift/*` (slime_sparse/drift/stats.py) says how far apart the two arms earn; a gap
significant at two probes in a row prints one `warning:` line naming the flag to raise. Under
`--kv-budget-schedule drift` the same verdict moves the budget (slime_sparse/drift/budget.py): the rollout engine is
then wrapped (`AdaptiveEngine`) so that every generate() of the run, a custom rollout function's too, runs under
the budget in force.

Engines: the embedded engine generates each arm as one call with `kv=` (a view of the same weights); the SGLang
engine sends the dense arm's requests with the plugin's per-request opt-out (custom_params
{"slime_sparse_dense": true}: the request keeps its whole cache), the compressed arm as the rollouts' requests, each
request seeded with the same per-sample seed (SGLang draws reproducibly on its plain multinomial path: no top-k /
top-p). Its servers keep the budget they started with, so there the budget that adapts moves between that and dense.

The probe draws no randomness the training uses (its seeds are derived from the run's seed, the rollout and a stream
of its own) and changes neither the learner nor the data stream, so a run's training numbers are the same with the
guard on or off; it costs the probe's generation (`perf/drift_probe_s`).
"""
from __future__ import annotations

import dataclasses
import sys
import time

from slime_sparse.data.prompt_dataset import PromptDataset
from slime_sparse.data.stream import record_of
from slime_sparse.drift.budget import AdaptiveBudget, KVLedger, describe, ladder
from slime_sparse.drift.stats import ALARM_PROBES, Arm, Streak, compressed_after, probe_metrics, significance
from slime_sparse.flags import flag_for
from slime_sparse.kv import KVCompressConfig
from slime_sparse.kv.schedule import never_compresses
from slime_sparse.preflight import warn
from slime_sparse.rollout.base import KVView
from slime_sparse.rollout.pipeline import assign_rewards, to_samples
from slime_sparse.rollout.sampling import derive_seed

PROBE_STREAM = -(1 << 40)  # derive_seed index of a probe's seed: no rollout round draws from it
DENSE = KVCompressConfig(method="none")
STATE_KEY = "drift"  # where a checkpoint's `extra` keeps the guard's state


def probe_prompts(cfg, components) -> tuple[list, int]:
    """The probe's prompt records (the first --drift-probe-prompts of --drift-probe-data, else of the first evaluation
    set, none of them a training prompt) and how many were left out for being training prompts."""
    if cfg.drift.probe_data:
        data = PromptDataset(dataclasses.replace(cfg.data, prompt_data=cfg.drift.probe_data, shuffle=False),
                             components.tokenizer)
        prompts = list(data.prompts)
    elif components.eval_sets:
        prompts = list(next(iter(components.eval_sets.values())))
    else:
        return [], 0
    training = {tuple(p.prompt_ids) for p in components.stream.dataset.prompts}
    held_out = [p for p in prompts if tuple(p.prompt_ids) not in training]
    chosen = held_out[: cfg.drift.probe_prompts]
    return [record_of(p, index=i, epoch=0) for i, p in enumerate(chosen)], len(prompts) - len(held_out)


class DriftGuard:
    """The probe, its alarm and (under --kv-budget-schedule drift) the budget in force; `state_dict` goes into every
    checkpoint, so a resumed run continues with the same budget, streaks and KV ledger."""

    def __init__(self, cfg, records: list, longest_sequence: int) -> None:
        if len(records) < 2:
            raise ValueError(f"the drift guard needs at least 2 probe prompts, got {len(records)}")
        self.cfg, self.records = cfg, records
        self.alarm = Streak()  # significance at the budget in force (the adaptive budget keeps its own)
        self.adaptive = AdaptiveBudget(ladder(cfg.kv.budget, cfg.drift.budget_max, longest_sequence - cfg.kv.buffer)) \
            if cfg.kv.adaptive else None
        self.ledger = KVLedger()
        self.first_alarm: int | None = None  # the rollout (1-based) before which the alarm first held
        self.warned = False

    # ---- what rollouts run under ----
    def kv_for(self, budget: int | None) -> KVCompressConfig:
        return DENSE if budget is None else dataclasses.replace(self.cfg.kv, budget=budget)

    @property
    def current_kv(self) -> KVCompressConfig:
        """The KV config rollouts use now: the run's, or the adaptive budget's rung."""
        return self.cfg.kv if self.adaptive is None else self.kv_for(self.adaptive.budget)

    def due(self, rollout_id: int) -> bool:
        return rollout_id % self.cfg.drift.probe_interval == 0

    # ---- the probe ----
    def _arm(self, components, kv: KVCompressConfig, seed: int) -> Arm:
        n = self.cfg.rollout.n_samples_per_prompt
        outputs = components.engine.generate([r.prompt_ids for r in self.records for _ in range(n)],
                                             self.cfg.sampling, seed=seed, kv=kv)
        samples = to_samples(self.records, outputs, n)
        assign_rewards(samples, components.tokenizer, components.reward_fn)
        compressed = [compressed_after(len(s.prompt_ids), len(s.response_ids),
                                       int(s.evictions.starts[0]) if s.evictions is not None else None)
                      if s.evictions is not None or s.kv.compressions == 0 else None for s in samples]
        return Arm(rewards=[s.reward for s in samples], lengths=[len(s.response_ids) for s in samples],
                   responses=[s.response_ids for s in samples], groups=[s.prompt_index for s in samples],
                   compressed_tokens=compressed)

    def probe(self, components, rollout_id: int) -> dict[str, float]:
        """Probe the current policy before rollout `rollout_id` (0-based); its drift/* metrics. Prints the warning
        (once per run) and, under the adaptive budget, each move."""
        t0 = time.perf_counter()
        step = rollout_id + 1
        seed = derive_seed(self.cfg.train.seed * 1_000_003 + rollout_id, PROBE_STREAM)
        dense = self._arm(components, DENSE, seed)
        kv = self.current_kv
        comp = self._arm(components, kv, seed) if kv.enabled else dense
        metrics = probe_metrics(dense, comp)
        gap, se = metrics["drift/reward_gap"], metrics["drift/reward_gap_se"]
        sign = significance(gap, se) if kv.enabled else 0
        move = None
        if self.adaptive is None:
            self.alarm.update(sign)
            alarmed = self.alarm.alarmed
        else:
            below = None
            if self.adaptive.below is not None:
                metrics.update(probe_metrics(dense, self._arm(components, self.kv_for(self.adaptive.below), seed),
                                             prefix="drift/below/"))
                below = significance(metrics["drift/below/reward_gap"], metrics["drift/below/reward_gap_se"])
            evidence = {k.removeprefix("drift/"): round(v, 6) for k, v in metrics.items()
                        if k.endswith(("reward_gap", "reward_gap_se"))}
            move = self.adaptive.observe(step, sign, below, evidence)
            alarmed = self.adaptive.alarmed
            if move is not None:
                shown = ", ".join(f"{k} {v:+.3f}" for k, v in evidence.items())
                print(f"drift guard: rollout {step}: {flag_for('kv', 'budget')} {move['from']} -> {move['to']} "
                      f"({flag_for('kv', 'budget_schedule')} drift): {move['why']} ({shown})", file=sys.stderr,
                      flush=True)
        metrics["drift/alarm"] = float(alarmed)
        if alarmed and self.first_alarm is None:
            self.first_alarm = step
        if alarmed and not self.warned and (self.adaptive is None or (move is None and self.adaptive.at_top)):
            self._warn(step, gap, se)
        metrics["perf/drift_probe_s"] = time.perf_counter() - t0
        return metrics

    def _warn(self, step: int, gap: float, se: float) -> None:
        self.warned = True
        more = "more" if gap > 0 else "less"
        if self.adaptive is None:
            advice = (f"raise {flag_for('kv', 'budget')} (now {self.cfg.kv.budget}) or let the guard do it, "
                      f"{flag_for('kv', 'budget_schedule')} drift")
        else:
            advice = f"raise {flag_for('drift', 'budget_max')} (now {self.cfg.drift.budget_max})"
        warn(f"rollout {step}: drift guard: on {len(self.records)} held-out prompts the policy earns {gap:+.3f} "
             f"(se {se:.3f}) reward {more} answering densely than under the rollouts' KV cache, at {ALARM_PROBES} "
             f"probes in a row: training on these rollouts may teach what pays under compression rather than what "
             f"dense training would; {advice} (drift/* in metrics.jsonl; shown once per run)")

    # ---- every rollout ----
    def account(self, metrics: dict[str, float]) -> dict[str, float]:
        """The rollout's KV added to the run's ledger; drift/kv_budget (0: dense) and drift/run_kv_savings."""
        self.ledger.add(metrics.get("kv/kept_tokens", 0.0), metrics.get("kv/dense_tokens", 0.0))
        budget = self.current_kv.budget if self.current_kv.enabled else 0
        return {"drift/kv_budget": float(budget), "drift/run_kv_savings": self.ledger.savings}

    def summary(self) -> dict:
        out = {"first_alarm_rollout": self.first_alarm, "run_kv_savings": self.ledger.savings}
        if self.adaptive is not None:
            out.update(budget=describe(self.adaptive.budget), changes=self.adaptive.changes)
        return out

    def state_dict(self) -> dict:
        return {"alarm": self.alarm.state_dict(), "ledger": self.ledger.state_dict(), "first_alarm": self.first_alarm,
                "warned": self.warned, "adaptive": None if self.adaptive is None else self.adaptive.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.alarm = Streak.from_state(state["alarm"])
        self.ledger.load_state_dict(state["ledger"])
        self.first_alarm, self.warned = state["first_alarm"], bool(state["warned"])
        if self.adaptive is not None and state.get("adaptive") is not None:
            self.adaptive.load_state_dict(state["adaptive"])


class AdaptiveEngine:
    """The rollout engine under the budget the guard holds now: generate() without `kv=` runs under
    `guard.current_kv`; everything else is the engine's own."""

    def __init__(self, engine, guard: DriftGuard) -> None:
        self.engine, self.guard = engine, guard

    def generate(self, prompts, params, seed=None, index_offset: int = 0, *, kv=None):
        return self.engine.generate(prompts, params, seed, index_offset, kv=self.guard.current_kv if kv is None else kv)

    def with_kv(self, kv) -> KVView:
        self.engine.with_kv(kv)  # the engine validates `kv`
        return KVView(self, kv)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def build_guard(cfg, components) -> DriftGuard | None:
    """The run's drift guard, or None where it is off: rollouts that do not compress, --drift-probe-interval 0, or
    no held-out prompts (then with a warning). Under --kv-budget-schedule drift it wraps the rollout engine."""
    longest_prompt = max(len(p.prompt_ids) for p in components.stream.dataset.prompts)
    if not cfg.kv.enabled or cfg.drift.probe_interval == 0 or \
            never_compresses(cfg.kv, longest_prompt, cfg.sampling.max_new_tokens) and not cfg.kv.adaptive:
        return None  # nothing to compare (a budget no rollout reaches has its own start-up warning)
    records, left_out = probe_prompts(cfg, components)
    source = flag_for("drift", "probe_data") if cfg.drift.probe_data else flag_for("eval", "eval_prompt_data")
    if left_out:
        warn(f"drift guard: {left_out} prompts of {source} are also training prompts and are not probed")
    if len(records) < 2:
        if cfg.kv.adaptive:
            raise ValueError(f"{flag_for('kv', 'budget_schedule')} drift: the drift guard found {len(records)} "
                             f"held-out probe prompts in {source} (it needs 2)")
        warn(f"no held-out prompts ({flag_for('eval', 'eval_prompt_data')} or {flag_for('drift', 'probe_data')}): "
             "the drift guard is off, so nothing checks that compressed rollouts teach what dense ones would "
             f"({flag_for('drift', 'probe_interval')} 0 turns the guard off without this warning)")
        return None
    guard = DriftGuard(cfg, records, longest_prompt + cfg.sampling.max_new_tokens)
    if guard.adaptive is not None:
        components.engine = AdaptiveEngine(components.engine, guard)
    return guard
