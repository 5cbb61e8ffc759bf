"""slime's --offload-rollout for an engine that shares its device with the learner: the engine holds its
accelerator memory (KV cache, CUDA graphs; SGLang: its memory saver's regions) only while it generates, and gives
it back for the learner's recompute, training and weight update.

A wrapper, so neither the loop nor the engines change: every call but `generate` goes straight to the engine
(weights stay resident, so `update_weights` / `sync_from` run while the memory is given back).
"""
from __future__ import annotations

from slime_sparse.rollout.base import KVView


class OffloadingEngine:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.engine.release_memory()  # whatever it allocated when built: the learner's until the first generate

    def generate(self, prompts, params, seed=None, *args, **kwargs):
        self.engine.resume_memory()
        try:
            return self.engine.generate(prompts, params, seed, *args, **kwargs)
        finally:
            self.engine.release_memory()

    def with_kv(self, kv) -> KVView:
        self.engine.with_kv(kv)  # the engine validates `kv`
        return KVView(self, kv)  # evaluation generates through this wrapper too

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
