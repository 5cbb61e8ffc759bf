"""slime_sparse: Sparse-RL (GRPO on compressed-KV rollouts) in a slime-style framework."""

__version__ = "0.1.0"
