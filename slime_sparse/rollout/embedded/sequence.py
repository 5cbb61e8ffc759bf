"""Per-sequence bookkeeping of the embedded engine: tokens, log-probs, progress through the model, evictions."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
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
    # a continuation (--partial-rollout): the aborted output it continues, whose response it starts with; its prefill
    # runs prompt + response[:-1] and replays the output's compressions (`replay`, in order) where they happened
    resumed: GenerationOutput | None = None
    replay: list[tuple[int, list]] = field(default_factory=list)  # (start, per stored layer [H', n] keep bits) left

    @classmethod
    def continuing(cls, index: int, out: GenerationOutput) -> "Sequence":
        """The continuation of an aborted output (finish_reason "abort"): its tokens, log-probs and random stream."""
        seq = cls(index=index, prompt=list(out.prompt_ids), key=int(out.stream_key), response=list(out.response_ids),
                  logprobs=list(out.logprobs), resumed=out)
        seq.replay = out.evictions.keep_bits_by_event() if out.evictions is not None else []
        return seq

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)

    @property
    def resumed_at(self) -> int:
        """Response tokens it had when this call began (0 unless a continuation)."""
        return len(self.resumed.response_ids) if self.resumed is not None else 0

    @property
    def prefill_tokens(self) -> list[int]:
        """What its prefill runs: the prompt, and a continuation's tokens but the last (its first decode input)."""
        return self.prompt + self.response[:-1] if self.resumed_at else self.prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending_prompt(self, room: int) -> list[int]:
        """The next tokens to prefill, at most `room` of them, and not past the next compression to replay."""
        tokens = self.prefill_tokens
        end = min(len(tokens), self.processed + room)
        if self.replay:
            end = min(end, self.replay[0][0])
        return tokens[self.processed : end]

    def append(self, token: int, logprob: float) -> None:
        self.response.append(token)
        self.logprobs.append(logprob)

    def output(self, weight_version: int, kept: list[int], peak: list[int], num_layers: int,
               record_shape: tuple[int, int, int] | None = None,
               record_budgets: tuple[int, ...] | None = None, aborted: bool = False) -> GenerationOutput:
        """kept[t] / peak[t]: slots summed over the layers / in the fullest layer when response token
        resumed_at + t was sampled (its logits' context). KV stats count slots per layer: the layer mean (exact
        under one budget). record_shape / record_budgets: the eviction record's (the compressor's). `aborted`: cut
        before its end (--partial-rollout): finish_reason "abort", every compression kept (the next token runs after
        them all)."""
        p, n = len(self.prompt), len(self.response)
        prior = self.resumed
        # a compression counts if a later token ran after it: it happened after start tokens were run, and the
        # last token the sequence ran is its (length - 2)-th (an aborted one's next token runs at length - 1)
        last = self.length - 1 if aborted else self.length - 2
        events = (prior.evictions.packed_events() if prior is not None and prior.evictions is not None else []) + [
            (start, packed.bits[i].numpy(), packed.nbits) for start, packed, i in self.evictions if start <= last]
        if prior is not None and prior.evictions is not None:
            record_shape, record_budgets = prior.evictions.shape, prior.evictions.budgets
        kv = KVStats(
            dense_kv_tokens=n * p + n * (n - 1) // 2,  # token t was sampled from p + t tokens of context
            kept_kv_tokens=round(sum(kept) / num_layers) + (prior.kv.kept_kv_tokens if prior is not None else 0),
            peak_kv_tokens=max([self.prefill_peak, *peak, prior.kv.peak_kv_tokens if prior is not None else 0]),
            compressions=len(events),
        )
        return GenerationOutput(
            prompt_ids=list(self.prompt),
            response_ids=list(self.response),
            logprobs=list(self.logprobs),
            finish_reason="abort" if aborted else self.finish_reason or "length",
            kv=kv,
            weight_version=weight_version,
            evictions=EvictionRecord.from_keep_bits(events, record_shape, record_budgets) if events else None,
            stream_key=self.key,
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


def held_trace(per_layer: list[Tensor], seqs: list[Sequence], positions) -> list[KVTraceRecord]:
    """The trace records of `seqs` (sharing one row) from what each layer of it holds (`cache.held_positions`)."""
    per_layer = [h.cpu() for h in per_layer]
    # [L, Hkv, n] when every layer holds n slots; per-layer budgets: one [Hkv, n_l] per layer
    held = torch.stack(per_layer) if len({h.shape[-1] for h in per_layer}) == 1 else per_layer
    return [KVTraceRecord(seq.index, list(positions), held) for seq in seqs]


def prompt_groups(admitted: list[Sequence], first: int) -> tuple[list[Sequence], list[Sequence], dict[int, list[int]]]:
    """Admitted sequences as prompt groups placed from row `first`: the leaders (each distinct prompt's first
    sample; a continuation prefills its own tokens, a group of its own) in rows [first, first + n_leaders), the
    followers in the rows after; and leader id -> its group's rows, the leader's first."""
    groups: dict[tuple, list[Sequence]] = {}
    for seq in admitted:
        groups.setdefault((seq.index,) if seq.resumed_at else tuple(seq.prompt), []).append(seq)
    leaders = [group[0] for group in groups.values()]
    rows_of: dict[int, list[int]] = {}
    follower_row = first + len(leaders)
    for b, group in enumerate(groups.values()):
        rows_of[id(group[0])] = [first + b, *range(follower_row, follower_row + len(group) - 1)]
        follower_row += len(group) - 1
    return leaders, [f for group in groups.values() for f in group[1:]], rows_of


@dataclass
class Readback:
    """A decode window's tokens on their way to the host: row r of the window belonged to sequences[r]."""

    sequences: list[Sequence]
    tokens: Tensor  # [n, steps]
    logprobs: Tensor
    event: "torch.cuda.Event | None"

    def hand_out(self) -> Iterator[tuple[Sequence, int, float]]:
        """Each sequence's tokens of the window in order, up to its end (`finished`, read before each token: the
        consumer appends them), once the copies are done."""
        if self.event is not None:
            self.event.synchronize()
        for seq, tokens, logprobs in zip(self.sequences, self.tokens.tolist(), self.logprobs.tolist()):
            for token, logprob in zip(tokens, logprobs):
                if seq.finished:
                    break
                yield seq, token, logprob
