"""Megatron-core learner backend (`--train-backend megatron`) and the HF <-> Megatron weight mapping.

Importing this package does not import megatron-core; its modules import it when used. See README.md.
"""
from .learner import MegatronConfig, MegatronLearner, OptimConfig, build_megatron_learner

__all__ = ["MegatronConfig", "MegatronLearner", "OptimConfig", "build_megatron_learner"]
