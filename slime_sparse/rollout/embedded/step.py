"""The decode step: one new token for every row of a batch, at fixed shapes, with no host synchronisation.

Everything a step reads or writes lives in device tensors at fixed addresses: the runner's `DecodeState` (the token
each row runs next, its logical position, its random stream key and counter, the output columns of the current
readback window) and the cache (`BudgetKVCache`: keys, values, fills, query ring). A step runs rows [0, n) for a
padded row count n, reads each layer's first `spans[l]` slots, samples with the counter-based stream
(`sampling.sample_tokens`) and advances the state in place. Nothing in it depends on a value on the device, so the
same function runs eagerly, under torch.compile(fullgraph=True) (the proof: a graph break or a host sync would fail
it), or as the replay of a CUDA graph captured once per (n, spans, sampling) (nano-vllm's and SGLang's decode graphs,
with eviction kept on: compaction runs between steps, as a graph of its own; see compressor.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from slime_sparse.kv.engine_memory import SPAN_GRANULARITY
from slime_sparse.rollout.sampling import SamplingParams, sample_tokens

from .attention import CACHE_KWARG, NO_MASK, cache_keyword
from .cache import BudgetKVCache, DecodeView
from .graphs import CapturedGraphs

# cuda_graph_compile: the step compiled by inductor (its own cudagraphs off) and captured in our graphs (SGLang's
# torch.compile + hand-captured graphs): kernels fused and launched from one graph replay
STEP_MODES = ("eager", "compile", "cuda_graph", "cuda_graph_compile")


@dataclass
class DecodeState:
    """Per-row decode state, device tensors at fixed addresses (what a captured step reads and updates)."""

    tokens: Tensor  # [R] long: the token each row runs next (the one sampled last)
    positions: Tensor  # [R] long: its logical position in the sequence
    keys: Tensor  # [R] int64: the row's random stream key (derive_seed(seed, sample index))
    counters: Tensor  # [R] long: index in the response of the token the row samples next
    out_tokens: Tensor  # [R, K] long: tokens sampled in the current readback window, one column per step
    out_logprobs: Tensor  # [R, K] float32: their log-probs
    column: Tensor  # [] long: the column of the next step

    @classmethod
    def allocate(cls, rows: int, window: int, device: torch.device) -> "DecodeState":
        def longs(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(tokens=longs(rows), positions=longs(rows), keys=longs(rows), counters=longs(rows),
                   out_tokens=longs(rows, window), out_logprobs=torch.zeros(rows, window, device=device),
                   column=longs())

    def set_rows(self, rows: Tensor, tokens: Tensor, positions: Tensor, keys: Tensor) -> None:
        """Newly admitted rows (an index on the device): each runs its first sampled token at `positions` next and
        samples response token 1 next."""
        self.tokens[rows] = tokens
        self.positions[rows] = positions
        self.keys[rows] = keys
        self.counters[rows] = torch.ones_like(keys)

    def copy_row(self, src: int, dst: int) -> None:
        for tensor in (self.tokens, self.positions, self.keys, self.counters, self.out_tokens, self.out_logprobs):
            tensor[dst] = tensor[src]


class DecodeStep:
    """`step(n, spans, params)`: one decode step over rows [0, n), eager, compiled, or replayed from a CUDA graph.
    `decode_body`: our decode body (decode_body.py) for the step's forward; None: HF's body (prefill always is)."""

    def __init__(self, model: nn.Module, cache: BudgetKVCache, state: DecodeState, logits: Callable[[Tensor], Tensor],
                 mode: str = "eager", graphs: CapturedGraphs | None = None,
                 decode_body: Callable[[Tensor, Tensor, BudgetKVCache], Tensor] | None = None) -> None:
        if mode not in STEP_MODES:
            raise ValueError(f"decode step mode {mode!r} is invalid: choose one of {STEP_MODES}")
        self.body = model.base_model  # the body under the LM head (contract.py)
        self.cache_kwarg = cache_keyword(self.body)
        self.cache, self.state, self.logits = cache, state, logits
        self.decode_body = decode_body
        self.mode = mode
        self.params = SamplingParams()
        compiled = mode in ("compile", "cuda_graph_compile")
        self._fn = torch.compile(self.run, fullgraph=True, dynamic=None) if compiled else self.run
        self.graphs = graphs if mode.startswith("cuda_graph") else None

    def __call__(self, n: int, spans: tuple[int, ...], params: SamplingParams) -> None:
        self.params = params
        if self.graphs is not None:
            self.graphs.run(("decode", n, spans, params.temperature, params.top_p, params.top_k),
                            lambda: self._fn(n, spans))
        else:
            self._fn(n, spans)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """The model body over the cache's current step: final hidden states of every row's last column."""
        return self.body(
            input_ids=input_ids, position_ids=position_ids, attention_mask=NO_MASK, use_cache=True,
            **{self.cache_kwarg: self.cache, CACHE_KWARG: self.cache},
        ).last_hidden_state[:, -1]

    def run(self, n: int, spans: tuple[int, ...]) -> None:
        """The step itself (what compile traces and a graph captures)."""
        st, cache = self.state, self.cache
        cache.begin(DecodeView(n, spans, st.positions[:n]))
        if self.decode_body is not None:
            hidden = self.decode_body(st.tokens[:n], st.positions[:n], cache)
        else:
            hidden = self.forward(st.tokens[:n, None], st.positions[:n, None])
        tokens, logprobs = sample_tokens(self.logits(hidden), self.params, st.keys[:n], st.counters[:n])
        column = st.column.view(1)
        st.out_tokens[:n].index_copy_(1, column, tokens[:, None])
        st.out_logprobs[:n].index_copy_(1, column, logprobs[:, None])
        st.tokens[:n] = tokens
        st.positions[:n].add_(1)  # in place on the view: `+=` on a slice would copy back
        st.counters[:n].add_(1)
        st.column.add_(1)
        cache.end_decode()


@dataclass(frozen=True)
class StepShape:
    """What the scheduler plans a call's steps with (`ModelRunner.step_shape`): the row counts decode steps and
    compactions pad to, the span granularity, the readback window; and what the eviction record stores."""

    buckets: tuple[int, ...]
    span_granularity: int
    readback: int
    record_shape: tuple[int, int, int] | None  # (layers, heads, largest budget); None: compression off
    record_budgets: tuple[int, ...] | None


def decode_shapes(mode: str, max_rows: int) -> tuple[list[int], int]:
    """(row counts, span granularity) decode steps run at. Captured or compiled steps pad to few shapes, each a graph
    of its own: rows 1, 2, 4, 8, then every 8 (SGLang's schedule) and max_rows, spans in multiples of
    SPAN_GRANULARITY. Eager steps run exactly the rows and slots they have."""
    if mode == "eager":
        return list(range(1, max_rows + 1)), 1
    sizes = [s for s in (1, 2, 4) if s < max_rows] + list(range(8, max_rows, 8))
    return sizes + [max_rows], SPAN_GRANULARITY


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest captured row count that holds n rows."""
    return next(b for b in buckets if b >= n)
