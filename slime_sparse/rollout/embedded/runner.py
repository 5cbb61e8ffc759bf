"""The device side of the engine, built once per (KV config, capacity, rows) and reused across generate() calls:
the cache, the decode state, the decode step and the compressor, with their CUDA graphs (nano-vllm's ModelRunner).

A second generate() under the same config captures nothing: the graphs are keyed by (rows, spans, sampling) and by
(rows, slots, queries) for compactions, and live as long as the runner. The engine drops the runner when the KV config
changes (a dense evaluation) or when a call needs more rows or slots than it holds. Between rollouts the runner can
give its cache's memory back and take it again (`release` / `resume`, arena.py) without losing its graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from slime_sparse.kv import KVCompressConfig, engine_memory
from slime_sparse.rollout.sampling import SamplingParams, sample_tokens
from slime_sparse.utils.model_shape import ModelShape

from .arena import new_arena
from .cache import BudgetKVCache
from .compressor import Compressor
from .graphs import CapturedGraphs
from .orders import Compact, Decode, Prefill, ReadTokens, SampleFirst, WorkOrder
from .plan import build_plan
from .step import DecodeState, DecodeStep, StepShape, decode_shapes
from .transfer import to_device, to_host


@dataclass(frozen=True)
class RunnerShape:
    """What a runner is built for; a call fits a runner whose KV config, mode and window match and whose rows and
    capacity are at least what the call needs."""

    kv: KVCompressConfig
    rows: int
    capacity: int
    mode: str
    readback: int

    def holds(self, other: "RunnerShape") -> bool:
        return (self.kv, self.mode, self.readback) == (other.kv, other.mode, other.readback) \
            and self.rows >= other.rows and self.capacity >= other.capacity


def row_bytes(model_config, kv: KVCompressConfig, capacity: int, dtype: torch.dtype) -> int:
    """Device bytes one row holds for its whole life (keys, values, positions, the query ring, attention mass, its
    decode state): `kv.engine_memory.row_bytes` of an HF config. Admission counts the working sets too
    (`EmbeddedEngine.memory_spec`)."""
    return engine_memory.row_bytes(model_shape(model_config), kv, capacity, torch.empty((), dtype=dtype).element_size())


def model_shape(model_config) -> ModelShape:
    """The model's dimensions (head_dim among them: `head_dim`, else hidden / heads), read from an HF config once."""
    return ModelShape.from_hf_config(model_config.to_dict())


class ModelRunner:
    def __init__(self, model: nn.Module, shape: RunnerShape, budgets: tuple[int, ...], device: torch.device,
                 logits: Callable[[Tensor], Tensor], decode_body: Callable | None = None,
                 decode_attention: str = "sdpa", releasable: bool = False) -> None:
        """releasable: the cache's memory will be given back between calls with its graphs kept (`release`): on
        CUDA with graphs, the cache then lives at fixed virtual addresses (arena.py)."""
        dims = model_shape(model.config)
        kv = shape.kv
        self.shape, self.device, self.logits = shape, device, logits
        self.arena = new_arena(device, releasable, shape.mode)
        self.cache = BudgetKVCache(
            num_rows=shape.rows, num_layers=dims.num_layers, num_kv_heads=dims.num_kv_heads,
            num_q_heads=dims.num_heads, head_dim=dims.head_dim, capacity=shape.capacity, window=kv.window,
            record_queries=kv.traits.needs_queries, track_mass=kv.traits.tracks_mass, device=device,
            dtype=model.dtype, shared_fill=len(set(budgets)) == 1, zeros=self.arena.zeros)
        self.cache.decode_backend = decode_attention
        self.state = DecodeState.allocate(shape.rows, shape.readback, device)
        self.graphs = CapturedGraphs() if shape.mode.startswith("cuda_graph") else None
        self.step = DecodeStep(model, self.cache, self.state, logits, shape.mode, self.graphs, decode_body)
        self.compressor = Compressor(self.cache, kv, budgets, self.graphs) if kv.enabled else None
        self.buckets, self.span_granularity = decode_shapes(shape.mode, shape.rows)

    @property
    def step_shape(self) -> StepShape:
        record = self.compressor
        return StepShape(tuple(self.buckets), self.span_granularity, self.shape.readback,
                         record.record_shape if record else None, record.record_budgets if record else None)

    def run(self, order: WorkOrder):
        """Run one of the scheduler's work orders on the device; its result (orders.py says which)."""
        if isinstance(order, Decode):
            return self.step(order.bucket, order.spans, order.params)
        if isinstance(order, Compact):
            return self.compressor(order.rows, order.sizes, order.m, order.bucket if self.graphs is not None else None)
        if isinstance(order, Prefill):
            return self.prefill(order.first, order.chunks, order.positions, order.fills)
        if isinstance(order, SampleFirst):
            logits = order.logits[torch.tensor(order.batch, device=order.logits.device)]
            return self.sample_first(order.rows, logits, order.params, order.positions, order.keys)
        if isinstance(order, ReadTokens):
            return self.readback(order.n, order.steps)
        raise TypeError(f"not a work order: {order!r}")

    @property
    def captures(self) -> int:
        return self.graphs.captures if self.graphs is not None else 0

    # ---- memory between calls (--offload-rollout) ----
    @property
    def can_release(self) -> bool:
        """Whether `release` keeps the runner usable: its graphs (if any) survive the cache's memory going back."""
        return self.graphs is None or self.arena.keeps_addresses

    @property
    def released(self) -> bool:
        return self.arena.released

    def release(self) -> None:
        """Give the cache's memory back; everything else (decode state, graphs and their pool) stays."""
        self.arena.release()

    def resume(self) -> None:
        """Take the cache's memory again (zeroed); the next call replays the graphs it captured before."""
        self.arena.resume()

    # ---- prefill (eager: its shapes vary) ----
    def prefill(self, row_start: int, chunks: list[list[int]], first_positions: list[int],
                fills: list[list[int]]) -> Tensor:
        """Run each row's chunk through the model (rows [row_start, row_start + len(chunks)), holding fills[l][b]
        slots in layer l); next-token logits [n, V] of every row's last column."""
        plan = build_plan(row_start, chunks, fills, first_positions, self.shape.kv.window, self.device)
        self.cache.begin(plan)
        hidden = self.step.forward(plan.input_ids, plan.position_ids)
        self.cache.end_prefill()
        return self.logits(hidden)

    def sample_first(self, rows: list[int], logits: Tensor, params: SamplingParams, positions: list[int],
                     keys: list[int]) -> tuple[list[int], list[float]]:
        """Sample the first response token of `rows` from their prompts' logits [n, V] (row i from logits[i]), set the
        rows up for decoding, and return the tokens and log-probs (read back at once: prefill is eager)."""
        host = to_device([*rows, *positions, *keys], self.device).view(3, -1)
        tokens, logprobs = sample_tokens(logits, params, host[2], torch.zeros_like(host[2]))
        self.state.set_rows(host[0], tokens, host[1], host[2])
        return tokens.tolist(), logprobs.tolist()

    # ---- decode ----
    def readback(self, n: int, steps: int) -> tuple[Tensor, Tensor, "torch.cuda.Event | None"]:
        """Copy the tokens and log-probs of the last `steps` decode steps of rows [0, n) to the host without waiting,
        and start a new window; the event (CUDA) says when the copies are done."""
        st = self.state
        tokens, logprobs = to_host(st.out_tokens[:n, :steps]), to_host(st.out_logprobs[:n, :steps])
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        st.column.zero_()
        return tokens, logprobs, event
