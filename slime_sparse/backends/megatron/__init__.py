"""Megatron-core learner backend (`--train-backend megatron`) and the HF <-> Megatron weight mapping.

Importing this package does not import megatron-core; its modules import it when used. See README.md.
"""
from slime_sparse.backends.optimizer import OptimConfig

from .config import MegatronConfig
from .learner import MegatronLearner, build_megatron_learner

__all__ = ["MegatronConfig", "MegatronLearner", "OptimConfig", "build_megatron_learner"]
