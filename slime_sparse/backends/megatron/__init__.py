"""Megatron-core learner backend (`--train-backend megatron`) and the HF <-> Megatron weight mapping.

Importing this package does not import megatron-core; its modules do, when used. See README.md here.
"""
