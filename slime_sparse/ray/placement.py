"""Connecting to Ray and reserving the run's devices in one placement group (slime's layout).

    cluster = RayCluster.start(cfg.cluster, device="auto")  # ray.init + placement group, bounded waits
    cluster.strategy(bundle)                                 # scheduling strategy of an actor in that bundle
    cluster.close()                                          # remove the group (and stop Ray if we started it)
"""
from __future__ import annotations

import logging

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .layout import ClusterLayout, order_by_node
from .utils import get

logger = logging.getLogger(__name__)


def connect(address: str) -> bool:
    """ray.init unless Ray is already up; True when this call started it (so close() should stop it).

    address (--ray-address), as ray.init reads it: "" = $RAY_ADDRESS (set inside `ray job submit`), else the
    cluster `ray start` runs on this machine, else a new local instance; "local" = always a new local
    instance; "auto" = a running cluster or an error; "host:port" = that cluster's head node.
    """
    if ray.is_initialized():
        return False
    ray.init(address=address or None)
    return True


def cluster_has_gpu() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


class RayCluster:
    """The run's placement group and the rank -> bundle map derived from its ClusterLayout."""

    def __init__(self, layout: ClusterLayout, *, timeout_s: float, started_ray: bool = False) -> None:
        self.layout = layout
        self.timeout_s = timeout_s
        self._started_ray = started_ray
        need = {k: v * layout.num_bundles for k, v in layout.bundle().items()}
        have = ray.cluster_resources()
        short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if have.get(k, 0.0) < v}
        if short:
            raise ValueError(
                f"the Ray cluster cannot hold {layout.num_bundles} bundles of {layout.bundle()}: "
                + ", ".join(f"{k} needed {n:g}, cluster has {h:g}" for k, (n, h) in short.items())
                + " (see --actor-num-nodes, --actor-num-gpus-per-node, --rollout-num-gpus, --colocate, "
                "--ray-cpus-per-actor)"
            )
        self.pg = placement_group([layout.bundle() for _ in range(layout.num_bundles)], strategy="PACK")
        try:
            get(self.pg.ready(), f"placement group of {layout.num_bundles} x {layout.bundle()}", timeout_s)
        except TimeoutError as exc:
            remove_placement_group(self.pg)
            raise TimeoutError(f"{exc}; resources free now: {ray.available_resources()} (other placement groups "
                               "or actors may hold the rest)") from None
        nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        # rank r uses bundle self.order[r]: ranks on one node are neighbours (slime sorts by node and GPU id)
        self.order = order_by_node([nodes[i] for i in range(layout.num_bundles)])
        logger.info("placement group: %d bundles of %s on %d node(s)", layout.num_bundles, layout.bundle(),
                    len(set(nodes.values())))

    @classmethod
    def start(cls, cluster_cfg, *, device: str = "auto") -> "RayCluster":
        """Connect to (or start) Ray and reserve the layout of `cluster_cfg` (a config.ClusterConfig).

        device (--device): "auto" uses GPU bundles when the cluster has GPUs, "cpu" never, "cuda" requires them.
        """
        started = connect(cluster_cfg.ray_address)
        try:
            has_gpu = cluster_has_gpu()
            if device == "cuda" and not has_gpu:
                raise ValueError("--device=cuda but the Ray cluster has no GPU")
            layout = ClusterLayout.from_config(cluster_cfg, use_gpu=has_gpu and device != "cpu")
            return cls(layout, timeout_s=cluster_cfg.ray_timeout_s, started_ray=started)
        except BaseException:
            if started:
                ray.shutdown()
            raise

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy for an actor in (layout-order) `bundle`."""
        return PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                placement_group_bundle_index=self.order[bundle],
                                                placement_group_capture_child_tasks=True)

    def actor_options(self, bundle: int) -> dict:
        """Ray options of a learner or engine actor living in `bundle`."""
        return {**self.layout.actor_resources(), "scheduling_strategy": self.strategy(bundle)}

    def close(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

