"""The budget that adapts (`--kv-budget-schedule drift`): a ladder of KV budgets and the rule that moves along it.
Pure Python (nothing of ours), so that the rule is read and tested alone.

The ladder starts at --kv-budget and doubles up to --kv-budget-max; unset, it ends with a dense cache (a budget of
None), where the run trains as dense GRPO does. The rule, on every probe:
- up one rung when the compressed arm's reward gap (dense minus compressed, at the rung in force) has been
  significant for two probes in a row (the guard's alarm);
- down one rung when the rung below, probed beside it (a third arm), has shown no significant gap for two probes in
  a row: its compressed rollouts earn what dense ones earn, so its KV saving is safe to take back.
Each move restarts both streaks: the new rung needs evidence of its own. Every move is kept (rollout, from, to, the
gap that moved it), so a run's log and checkpoints say when and why the budget changed.

The KV ledger sums the rollouts' KV token-steps (kept and dense), so the KV saved over the whole run is one number,
however the budget moved.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from slime_sparse.drift.stats import Streak


def ladder(start: int, budget_max: int | None, dense_at: int) -> list[int | None]:
    """Budgets from `start`, doubling: up to `budget_max` (its value itself ends the ladder when a doubling would
    step past it), or, `budget_max` None, up to a dense cache (None) in place of the first budget >= `dense_at`,
    the smallest one under which no rollout's cache would ever compress (the longest sequence minus the buffer)."""
    if start < 1:
        raise ValueError(f"the starting budget must be >= 1, got {start}")
    if budget_max is not None and budget_max <= start:
        raise ValueError(f"--kv-budget-max={budget_max} must exceed --kv-budget={start}")
    rungs: list[int | None] = [start]
    while True:
        nxt = rungs[-1] * 2
        if budget_max is not None:
            rungs.append(min(nxt, budget_max))
            if rungs[-1] == budget_max:
                return rungs
        elif nxt >= dense_at:
            return rungs + [None]
        else:
            rungs.append(nxt)


def describe(budget: int | None) -> str:
    return "dense" if budget is None else str(budget)


@dataclass
class AdaptiveBudget:
    """Where on the ladder a run is, and the two streaks that move it (see the module docstring)."""

    rungs: list[int | None]
    level: int = 0
    up: Streak = field(default_factory=Streak)  # significance of the gap at the rung in force
    down: Streak = field(default_factory=Streak)  # probes in a row where the rung below showed no gap
    changes: list[dict] = field(default_factory=list)
    alarmed: bool = False  # the last probe completed an alarm at the rung then in force (before any move)

    @property
    def budget(self) -> int | None:
        """The budget in force (None: dense)."""
        return self.rungs[self.level]

    @property
    def below(self) -> int | None:
        """The rung below the one in force, which the probe tries beside it (None at the bottom)."""
        return self.rungs[self.level - 1] if self.level > 0 else None

    @property
    def at_top(self) -> bool:
        return self.level == len(self.rungs) - 1

    def observe(self, rollout: int, sign: int, below_sign: int | None, evidence: dict | None = None) -> dict | None:
        """One probe before rollout `rollout` (1-based: the rollout about to run): `sign`, the significance of the gap
        at the rung in force (+1 / -1 / 0; 0 when it is dense); `below_sign`, that of the rung below (None: none
        probed); `evidence`: what the probe measured, kept with a move. Returns the move made ({"rollout", "from",
        "to", "why", **evidence}) or None."""
        self.up.update(sign)
        self.alarmed = self.up.alarmed
        if below_sign is not None:
            self.down.update(1 if below_sign == 0 else 0)  # a streak of "no gap below"
        move = None
        if self.alarmed and not self.at_top:
            move = self._move(rollout, +1, "the gap at the budget in force was significant twice in a row", evidence)
        elif below_sign is not None and self.down.count >= 2:
            move = self._move(rollout, -1, "the budget below showed no significant gap twice in a row", evidence)
        return move

    def _move(self, rollout: int, step: int, why: str, evidence: dict | None) -> dict:
        old = self.budget
        self.level += step
        self.up, self.down = Streak(), Streak()
        change = {"rollout": rollout, "from": describe(old), "to": describe(self.budget), "why": why,
                  **(evidence or {})}
        self.changes.append(change)
        return change

    def state_dict(self) -> dict:
        return {"rungs": list(self.rungs), "level": self.level, "up": self.up.state_dict(),
                "down": self.down.state_dict(), "changes": [dict(c) for c in self.changes]}

    def load_state_dict(self, state: dict) -> None:
        if list(state["rungs"]) != list(self.rungs):
            raise ValueError(f"the checkpoint's budget ladder {[describe(b) for b in state['rungs']]} is not this "
                             f"run's {[describe(b) for b in self.rungs]} (--kv-budget / --kv-budget-max changed)")
        self.level = int(state["level"])
        self.up, self.down = Streak.from_state(state["up"]), Streak.from_state(state["down"])
        self.changes = [dict(c) for c in state["changes"]]


@dataclass
class KVLedger:
    """KV token-steps over the run's rollouts: what the caches held (kept) against what dense ones would have."""

    kept: float = 0.0
    dense: float = 0.0

    def add(self, kept: float, dense: float) -> None:
        self.kept += kept
        self.dense += dense

    @property
    def savings(self) -> float:
        """1 - kept / dense over every rollout so far (0 before any)."""
        return 1.0 - self.kept / self.dense if self.dense else 0.0

    def state_dict(self) -> dict:
        return {"kept": self.kept, "dense": self.dense}

    def load_state_dict(self, state: dict) -> None:
        self.kept, self.dense = float(state["kept"]), float(state["dense"])
