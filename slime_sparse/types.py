"""Plain data that crosses component boundaries (engine -> loop -> learner).

Engines and learners never import each other; they meet through these records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime_sparse.kv.record import EvictionRecord


@dataclass
class KVStats:
    """KV-cache accounting of one generated sequence.

    dense_kv_tokens: sum over decode steps of the tokens a dense cache would hold (prompt + generated so far).
    kept_kv_tokens: the same sum for the tokens our cache actually held.
    peak_kv_tokens: the largest number of tokens held at once (per layer, per KV head).
    compressions: how many times the sequence's cache was compressed.
    """

    dense_kv_tokens: int = 0
    kept_kv_tokens: int = 0
    peak_kv_tokens: int = 0
    compressions: int = 0

    @property
    def savings(self) -> float:
        return 1.0 - self.kept_kv_tokens / self.dense_kv_tokens if self.dense_kv_tokens else 0.0


@dataclass
class GenerationOutput:
    """What a rollout engine returns for one prompt sample."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # sampler log-prob of each response token (pi_sparse), at the sampling temperature
    finish_reason: str  # "stop" (EOS / stop id), "length" (max new tokens)
    kv: KVStats = field(default_factory=KVStats)
    weight_version: int = 0
    # what the compressed cache let each token see (None: nothing evicted, or, with kv.compressions > 0, an SGLang
    # request retracted after a compression: no record can express its dense re-prefill)
    evictions: EvictionRecord | None = None
    # the sample's random stream key (finish_reason "abort": a continuation draws on from it, --partial-rollout)
    stream_key: int | None = None


@dataclass
class Sample:
    """One rollout sample as the training loop sees it."""

    prompt_index: int  # position of the prompt in the data stream (groups share it)
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    label: Any = None
    reward: float = 0.0
    kv: KVStats = field(default_factory=KVStats)
    weight_version: int = 0
    # the sparsity correction kept none of its tokens (set by rollout.pipeline.correct; None: not judged yet)
    rejected: bool | None = None
    metadata: dict = field(default_factory=dict)
    evictions: EvictionRecord | None = None  # the engine's record: the learner's shadow forward rebuilds its mask
    # (first response token, policy version: rollouts the learner had trained) of each stretch of the response that
    # one set of weights generated: one stretch, or several for a sample continued across rollouts (--partial-rollout)
    segments: list[tuple[int, int]] = field(default_factory=list)
