"""What the scheduler asks of the device, one work order at a time: the engine's step loop hands each to the runner
(`ModelRunner.run`) and its result back to the scheduler (nano-vllm's LLMEngine.step: schedule, run, postprocess).
The scheduler never calls the runner; the runner decides nothing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from torch import Tensor

from slime_sparse.rollout.sampling import SamplingParams


@dataclass(frozen=True)
class Prefill:
    """Each row's chunk through the model, rows [first, first + len(chunks)) holding fills[l][b] slots in layer l.
    Result: next-token logits [n, V] of every row's last column."""

    first: int
    chunks: list[list[int]]
    positions: list[int]  # logical position of each chunk's first token
    fills: list[list[int]]


@dataclass(frozen=True)
class SampleFirst:
    """The first response token of `rows` from their prompts' logits (row i from logits[batch[i]], a prefill's
    result); the rows are set up to decode. Result: (tokens, log-probs), read back at once (prefill is eager)."""

    rows: list[int]
    logits: Tensor
    batch: list[int]
    params: SamplingParams
    positions: list[int]  # where each row runs its first token
    keys: list[int]  # each row's random stream key


@dataclass(frozen=True)
class Decode:
    """One decode step over rows [0, bucket), layer l reading its first spans[l] slots. Result: None (the tokens stay on
    the device until a `ReadTokens`)."""

    bucket: int
    spans: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Compact:
    """Compress `rows` (each holding sizes[l] slots in layer l, scored with their last m queries) to their layer
    budgets; bucket: padded to that many rows (a decode-time compaction: a captured graph on CUDA).
    Result: PackedBits."""

    rows: list[int]
    sizes: tuple[int, ...]
    m: int
    bucket: int | None = None


@dataclass(frozen=True)
class ReadTokens:
    """The tokens and log-probs of the last `steps` decode steps of rows [0, n), copied without waiting. Result:
    (tokens, log-probs, CUDA event or None)."""

    n: int
    steps: int


WorkOrder = Union[Prefill, SampleFirst, Decode, Compact, ReadTokens]
