"""slime's train_async.py: rollout k + 1 generates while the learner trains on rollout k.

    slime-sparse-train --async ...        (or python -m slime_sparse.train_async ..., slime's entry point)

The loop (`async_loop`; the run, its stops, evaluations and checkpoints are train.py's):
1. take rollout k, generated in the background (the rollout function, rewards included, on a thread beside the
   learner; with --use-ray the engines are actors and the thread waits for them);
2. start rollout k + 1 at once, on the engines as they are;
3. recompute pi_old of rollout k with the learner's weights now (so xi = pi_old / pi_sparse carries staleness and
   sparsity alike, verl's decoupled three-policy form), and train on it;
4. every --update-weights-interval rollouts, before an evaluation and after the last rollout: wait for rollout k + 1
   to finish generating, then update the engines (slime's order: an update never lands mid-generation).

Staleness: each sample carries the policy version (rollouts trained) of the weights that wrote each stretch of it
(`Sample.segments`); trained at step k + 1 by a learner of version k, its staleness is k minus the oldest version
that carries a gradient. --max-staleness bounds it (AReaL's max_head_offpolicyness: checked against the interval at
start, enforced for partial rollouts by regenerating groups too old to continue, and asserted here); every sample's
is written to <run-dir>/samples.jsonl, the rollout's distribution to rollout/staleness_*.

Drift guard (--drift-probe-interval): its probe needs idle engines, so under --async it runs at the first weight
update after a due rollout, on the updated weights (those the next rollout submitted generates with); the adaptive
budget's moves reach the rollouts submitted after them.

Resume: a checkpoint after step k + 1 stores the data position after rollout k's prompts (and the partial groups it
carried on), not the position of the rollout in flight: a resumed run generates rollout k + 1 again, from the
restored weights, so every prompt is trained once (not bit for bit the uninterrupted run: its rollout k + 1 came from
older weights).
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """slime's train_async.py entry point: slime-sparse-train with --async (the loop: async_loop.py)."""
    from slime_sparse.train import main as train_main

    return train_main(["--async", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
