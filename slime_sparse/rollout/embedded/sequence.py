"""Per-sequence bookkeeping of the embedded engine: tokens, log-probs, progress through the model, KV stats."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from slime_sparse.kv.record import EvictionRecord
from slime_sparse.types import GenerationOutput, KVStats


@dataclass
class Sequence:
    index: int  # position of the prompt in the generate() call
    prompt: list[int]
    generator: torch.Generator | None  # None when greedy
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    processed: int = 0  # tokens already run through the model (their keys are, or were, in the cache)
    finish_reason: str | None = None
    kv: KVStats = field(default_factory=KVStats)
    evictions: list[tuple[int, Tensor]] = field(default_factory=list)  # (processed, kept positions [L, Hkv, B])

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending(self, room: int) -> list[int]:
        """The next tokens to run through the model, at most `room` of them (none once finished).

        While prefilling these are prompt tokens; while decoding, the one token sampled last.
        """
        if self.finished:
            return []
        # A token is sampled only once everything before it was processed, so a chunk never mixes prompt
        # and response tokens.
        n_prompt = len(self.prompt)
        if self.processed < n_prompt:
            return self.prompt[self.processed : min(n_prompt, self.processed + room)]
        start = self.processed - n_prompt
        return self.response[start : start + room]

    def append(self, token: int, logprob: float) -> None:
        self.response.append(token)
        self.logprobs.append(logprob)

    def output(self, weight_version: int) -> GenerationOutput:
        return GenerationOutput(
            prompt_ids=list(self.prompt),
            response_ids=list(self.response),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "length",
            kv=self.kv,
            weight_version=weight_version,
            evictions=EvictionRecord.from_events(self.evictions),
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
