"""Rollout engines: the protocol, sampling, and the embedded engine (`slime_sparse.rollout.embedded`).

The embedded engine is imported from its subpackage so that `import slime_sparse.rollout` stays light.
"""
from .base import RolloutEngine
from .sampling import SamplingParams

__all__ = ["RolloutEngine", "SamplingParams"]
