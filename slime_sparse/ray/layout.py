"""Which placement-group bundle each learner rank and rollout engine gets: pure arithmetic, no Ray.

Like slime, one placement group holds every bundle. Disaggregated, the learner ranks take bundles
[0, L) and the engines the next E * G (G = bundles per engine); colocated, both start at bundle 0 and
share them, each actor reserving a fraction of its bundle so Ray can place the two side by side.

    disaggregated  L=2, E=2, G=1:  [learner0][learner1][engine0][engine1]
    colocated      L=2, E=2, G=1:  [learner0+engine0][learner1+engine1]

A bundle is one GPU (plus `cpus_per_bundle` CPUs), or on a cluster without GPUs `cpus_per_bundle` CPUs.
"""
from __future__ import annotations

from dataclasses import dataclass

# Share of a colocated bundle each of its two actors reserves. Scheduling bookkeeping only: on a GPU the
# engine releases its memory while the learner trains (slime reserves 0.4 GPU for its train actor).
COLOCATED_SHARE = 0.5


@dataclass(frozen=True)
class ClusterLayout:
    learner_ranks: int
    num_engines: int
    bundles_per_engine: int = 1
    colocate: bool = False
    use_gpu: bool = False
    cpus_per_bundle: float = 1.0

    def __post_init__(self) -> None:
        for name in ("learner_ranks", "num_engines"):  # 0 places only the other kind (tests, tools)
            if getattr(self, name) < 0:
                raise ValueError(f"ClusterLayout.{name}={getattr(self, name)} must be >= 0")
        if self.bundles_per_engine < 1:
            raise ValueError(f"ClusterLayout.bundles_per_engine={self.bundles_per_engine} must be >= 1")
        if self.num_bundles < 1:
            raise ValueError("ClusterLayout places nothing: learner_ranks and num_engines are both 0")
        if self.cpus_per_bundle <= 0:
            raise ValueError(f"ClusterLayout.cpus_per_bundle={self.cpus_per_bundle} must be > 0 (--ray-cpus-per-actor)")

    @classmethod
    def from_config(cls, cluster, *, use_gpu: bool) -> "ClusterLayout":
        """From a `config.ClusterConfig` (slime's --actor-num-nodes, --rollout-num-gpus, ... flags)."""
        return cls(
            learner_ranks=cluster.num_learner_ranks,
            num_engines=cluster.num_engines,
            bundles_per_engine=cluster.rollout_num_gpus_per_engine,
            colocate=cluster.colocate,
            use_gpu=use_gpu,
            cpus_per_bundle=cluster.ray_cpus_per_actor,
        )

    @property
    def rollout_bundles(self) -> int:
        return self.num_engines * self.bundles_per_engine

    @property
    def num_bundles(self) -> int:
        if self.colocate:
            return max(self.learner_ranks, self.rollout_bundles)
        return self.learner_ranks + self.rollout_bundles

    def bundle(self) -> dict[str, float]:
        """Resources of one bundle."""
        resources = {"CPU": float(self.cpus_per_bundle)}
        if self.use_gpu:
            resources["GPU"] = 1.0
        return resources

    def learner_bundles(self) -> list[int]:
        """Bundle (in placement order) of each learner rank."""
        return list(range(self.learner_ranks))

    def engine_bundles(self) -> list[list[int]]:
        """Bundles of each engine; an engine's actor runs in the first, the others are reserved for its
        tensor-parallel workers (SGLang)."""
        offset = 0 if self.colocate else self.learner_ranks
        g = self.bundles_per_engine
        return [[offset + e * g + j for j in range(g)] for e in range(self.num_engines)]

    def actor_resources(self) -> dict[str, float]:
        """What one learner or engine actor reserves inside its bundle (Ray's num_cpus / num_gpus)."""
        share = COLOCATED_SHARE if self.colocate else 1.0
        resources = {"num_cpus": self.cpus_per_bundle * share}
        if self.use_gpu:
            resources["num_gpus"] = share
        return resources


def split_contiguous(n: int, parts: int) -> list[range]:
    """Cut range(n) into `parts` contiguous ranges whose sizes differ by at most one (larger ones first).

    Contiguous so that gathering the parts in order restores the input order; some ranges are empty
    when n < parts.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (p < extra)
        out.append(range(start, start + size))
        start += size
    return out


def order_by_node(bundle_nodes: list[str]) -> list[int]:
    """Bundle indices grouped by node (nodes in order of first appearance), so that consecutive ranks
    share a node where possible: neighbours in the DP ring then talk over the fastest link."""
    first_seen: dict[str, int] = {}
    for i, node in enumerate(bundle_nodes):
        first_seen.setdefault(node, i)
    return sorted(range(len(bundle_nodes)), key=lambda i: (first_seen[bundle_nodes[i]], i))
