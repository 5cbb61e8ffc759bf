"""Assemble the Ray execution of a run: placement group, learner group, rollout group.

Called by `components.build_backends` when --use-ray is set; the training loop then talks to the
two groups exactly as it talks to the in-process learner and engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from slime_sparse.config import RunConfig
from slime_sparse.factory import EngineSpec, LearnerSpec

from .learner_group import RayLearnerGroup
from .placement import RayCluster
from .rollout_group import RayRolloutGroup


@dataclass
class RayBackends:
    cluster: RayCluster
    learner: RayLearnerGroup
    engine: RayRolloutGroup

    def close(self) -> None:
        """Stop the actors, free the placement group, stop Ray if this run started it. Idempotent."""
        self.engine.close()
        self.learner.close()
        self.cluster.close()


def build_ray_backends(cfg: RunConfig) -> RayBackends:
    """Start (or join) Ray and place the learner ranks and engines of `cfg.cluster`; each actor receives only its
    role's spec (factory.LearnerSpec / EngineSpec)."""
    cluster = RayCluster.start(cfg.cluster, device=cfg.train.device)
    learner = engine = None
    try:
        learner = RayLearnerGroup(LearnerSpec.from_run(cfg), cluster)
        engine = RayRolloutGroup(EngineSpec.from_run(cfg), cluster, update_weight_mode=cfg.cluster.update_weight_mode,
                                 max_restarts=cfg.cluster.rollout_max_restarts)
    except BaseException:
        for part in (engine, learner, cluster):
            if part is not None:
                part.close()
        raise
    return RayBackends(cluster=cluster, learner=learner, engine=engine)
