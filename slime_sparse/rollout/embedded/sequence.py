"""Per-sequence bookkeeping of the embedded engine: tokens, log-probs, progress through the model, evictions."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from slime_sparse.kv.record import EvictionRecord
from slime_sparse.types import GenerationOutput, KVStats


@dataclass
class Sequence:
    index: int  # position of the prompt in the generate() call
    prompt: list[int]
    key: int  # its random stream key (derive_seed(seed, index)): token t draws with counter_stream(key, t)
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    processed: int = 0  # prompt tokens already run through the model (their keys are, or were, in the cache)
    finish_reason: str | None = None
    prefill_peak: int = 0  # most slots its cache held while the prompt was prefilled
    # (tokens processed before the compression, its compaction's packed keep bits, this row's index in them) in order;
    # the decode loop learns that a sequence ended a few steps late, so compressions after its end may trail here
    # (`output` drops them)
    evictions: list[tuple[int, Any, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending_prompt(self, room: int) -> list[int]:
        """The next prompt tokens to prefill, at most `room` of them."""
        return self.prompt[self.processed : min(len(self.prompt), self.processed + room)]

    def append(self, token: int, logprob: float) -> None:
        self.response.append(token)
        self.logprobs.append(logprob)

    def output(self, weight_version: int, kept: list[int], peak: list[int], num_layers: int,
               record_shape: tuple[int, int, int] | None = None,
               record_budgets: tuple[int, ...] | None = None) -> GenerationOutput:
        """kept[t] / peak[t]: slots summed over the layers / in the fullest layer when response token t was sampled
        (its logits' context). KV stats count slots per layer: the layer mean (exact under one budget).
        record_shape / record_budgets: the eviction record's (the compressor's)."""
        p, n = len(self.prompt), len(self.response)
        # a compression counts if a later token ran after it: it happened after start tokens were run, and the
        # last token the sequence ran is its (length - 2)-th
        events = [(start, packed.bits[i].numpy(), packed.nbits) for start, packed, i in self.evictions
                  if start < self.length - 1]
        kv = KVStats(
            dense_kv_tokens=n * p + n * (n - 1) // 2,  # token t was sampled from p + t tokens of context
            kept_kv_tokens=round(sum(kept) / num_layers),
            peak_kv_tokens=max([self.prefill_peak, *peak]),
            compressions=len(events),
        )
        return GenerationOutput(
            prompt_ids=list(self.prompt),
            response_ids=list(self.response),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "length",
            kv=kv,
            weight_version=weight_version,
            evictions=EvictionRecord.from_keep_bits(events, record_shape, record_budgets) if events else None,
        )


@dataclass(frozen=True)
class KVTraceRecord:
    """What one sequence's cache held in one forward (opt-in tracing, for tests and debugging).

    query_positions: logical positions of the tokens run in this forward.
    held_positions: [L, Hkv, n] logical positions of the slots held right after those tokens were written;
      the token at position q attended, in every layer and head, to exactly the held positions <= q.
    """

    sample_index: int
    query_positions: list[int]
    held_positions: Tensor
