"""Fused kernels for KV compression (Triton), each beside the PyTorch code it replaces, which stays the reference."""
