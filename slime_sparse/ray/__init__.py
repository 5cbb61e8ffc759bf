"""The training loop on Ray (`--use-ray`): learner ranks and rollout engines as actors, one driver.

    layout.py         which placement-group bundle each learner rank / engine gets (pure, no Ray)
    placement.py      RayCluster: ray.init / join, the run's placement group, bounded waits
    learner_group.py  RayLearnerGroup: the Learner protocol over data-parallel ranks (torch.distributed)
    rollout_group.py  RayRolloutGroup: the RolloutEngine protocol over engine actors; restarts dead ones
    build.py          build_ray_backends(cfg): the three above, wired for components.build_backends
    utils.py          timeouts: every Ray wait goes through get / get_each

Ray is optional: this package imports nothing, and its modules import `ray` only when --use-ray selects
them (layout.py not at all). The weight-sync wire protocol (learner rank 0 -> engines, bucketed broadcast with
checked versions) is torch.distributed, not Ray: slime_sparse/utils/weight_sync.py, so engines import it without
importing this package. Multi-node use: examples/multinode/README.md.
"""
