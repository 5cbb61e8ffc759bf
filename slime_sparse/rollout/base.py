"""The contract every rollout engine implements (embedded PyTorch, SGLang servers, a Ray group of either).

The training loop only talks to this protocol: token ids in, `GenerationOutput`s out, weights taken from a
learner, and the same engine seen under another KV config for evaluation.
"""
from __future__ import annotations

from typing import Iterator, Mapping, Protocol, runtime_checkable

import torch

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.types import GenerationOutput


class WeightSource(Protocol):
    """What an engine syncs from: a learner (any backend), seen only through its weights."""

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under Hugging Face names."""
        ...


@runtime_checkable
class RolloutEngine(Protocol):
    @property
    def weight_version(self) -> int:
        """Version of the weights now loaded; every GenerationOutput carries the version that produced it."""
        ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None, index_offset: int = 0, *,
        kv: KVCompressConfig | None = None,
    ) -> list[GenerationOutput]:
        """One output per prompt, in input order. The same seed and inputs give the same outputs.

        Each output holds the sampler's log-prob of every response token (see rollout.sampling for the
        convention) and the KV accounting of its sequence. `index_offset`: where these prompts sit in a larger
        call split across engines (sample i draws from the stream of (seed, index_offset + i)); `kv`: generate under
        this KV config instead of the engine's own (what `with_kv` hands on).
        """
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Load new weights (same names and shapes as the model's state dict) and bump weight_version."""
        ...

    def sync_from(self, learner: WeightSource) -> None:
        """Load `learner`'s current weights and bump weight_version. An engine may take them by a shorter way
        than update_weights (a Ray group: from learner rank 0 to the engine actors, past this process)."""
        ...

    def with_kv(self, kv: KVCompressConfig) -> "KVView":
        """This engine under another KV config (e.g. dense evaluation of a compressing engine), sharing its
        weights and version."""
        ...

    def release_memory(self) -> None:
        """Give back accelerator memory between rollouts (may be a no-op)."""
        ...

    def resume_memory(self) -> None:
        """Undo release_memory before the next generate (may be a no-op)."""
        ...


class KVView:
    """An engine seen under another KV config (what `RolloutEngine.with_kv` returns): generate() passes `kv` to
    the engine's own `generate(..., kv=)`; model, weights and version stay the engine's."""

    def __init__(self, engine, kv) -> None:
        self.engine = engine
        self.kv = kv

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 index_offset: int = 0) -> list[GenerationOutput]:
        return self.engine.generate(prompts, params, seed, index_offset, kv=self.kv)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        self.engine.update_weights(state_dict, version)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()
