"""Back-of-the-envelope memory plans: what a budgeted KV cache buys a rollout server, what a learner holds.

Pure arithmetic on an HF config, so a run can be sized before any GPU is touched (`tools/plan_memory.py`).
The rollout numbers follow the engines exactly where they can, through the budget rule they share (kv/schedule.py):
- the peak number of KV slots a request holds is the one SGLang's admission control reserves under our
  plugin (`sglang_patches.admission`): the prompt prefilled at once, then one slot per decode step for every
  output token but the last (dense = prompt + max_new - 1, budgeted = max(prefilled prompt, budget + buffer)
  capped by the dense value); the embedded engine prefills in chunks under the bound, so its slots per row
  are `schedule.row_capacity` = min(prompt + max_new, budget + buffer);
- KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x dtype bytes, the layout of both
  engines' caches; the plugin adds a ring of `window` post-RoPE queries per request and layer;
- per-layer budgets (kv/budgets.py): every layer fills to max_l B_l + buffer before the first compression (the
  trigger is the fullest layer's, kv/schedule.py), then layer l cycles in [B_l, B_l + buffer]. SGLang cannot hold them
  (one slot per token for every layer: sglang_patches.settings refuses them); they are planned for the embedded
  engine (a [layers, slots] row sized for the largest layer) and for a paged engine with per-layer pages ("paged":
  the sum over layers of each layer's peak, which under this trigger is every layer at max_l B_l + buffer for a
  sequence long enough to reach the first compression: a pyramid saves memory only between compressions).
The learner numbers are the standard mixed-precision accounting (weights, fp32 gradients, fp32 master
weights and Adam moments, the last two sharded over data parallelism by Megatron's distributed optimizer);
activations depend on micro-batch shapes and recomputation and are left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from slime_sparse.kv.budgets import layer_budgets
from slime_sparse.kv.config import KVCompressConfig
from slime_sparse.kv.schedule import peak_slots, row_capacity
from slime_sparse.utils.model_shape import ModelShape

ENGINES = ("sglang", "embedded", "paged")

GIB = 1 << 30


def peak_kv_slots(prompt_len: int, max_new_tokens: int, kv: KVCompressConfig | None, engine: str = "sglang") -> int:
    """Most KV slots one request holds at any time on `engine` ("sglang" or "embedded"), in its fullest layer."""
    _check_lengths(prompt_len, max_new_tokens)
    kv = kv if kv is not None else KVCompressConfig(method="none")
    if engine == "embedded":
        return row_capacity(kv, prompt_len + max_new_tokens)
    if engine != "sglang":
        raise ValueError(f"engine must be 'sglang' or 'embedded', got {engine!r}")
    if kv.enabled and kv.schedule != "uniform":
        raise ValueError(f"--kv-budget-schedule={kv.schedule}: SGLang holds one budget for every layer (plan "
                         "per-layer budgets with engine 'paged')")
    # the prompt's prefill writes it at once and samples the first token; each decode step writes one slot
    return peak_slots(prompt_len, max_new_tokens - 1, kv, first_decode=True)


def layer_peak_slots(prompt_len: int, max_new_tokens: int, kv: KVCompressConfig | None,
                     num_layers: int) -> tuple[int, ...]:
    """Most KV slots each layer of one request holds, prefilled at once as SGLang does (a paged engine)."""
    _check_lengths(prompt_len, max_new_tokens)
    if kv is None or not kv.enabled:
        return (prompt_len + max_new_tokens - 1,) * num_layers
    return tuple(peak_slots(prompt_len, max_new_tokens - 1, kv, first_decode=True, budget=b)
                 for b in layer_budgets(kv, num_layers))


def peak_kv_bytes(shape: ModelShape, prompt_len: int, max_new_tokens: int, kv: KVCompressConfig | None,
                  dtype_bytes: int, engine: str = "sglang") -> int:
    """K and V bytes one request holds at its peak on `engine`: "sglang" (one slot per token for every layer),
    "embedded" (a [layers, slots] row sized for the largest layer), or "paged" (per-layer pages, each layer its
    own peak)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    per_layer_token = shape.kv_bytes_per_token(dtype_bytes) // shape.num_layers
    if engine == "paged":
        return sum(layer_peak_slots(prompt_len, max_new_tokens, kv, shape.num_layers)) * per_layer_token
    return peak_kv_slots(prompt_len, max_new_tokens, kv, engine) * shape.kv_bytes_per_token(dtype_bytes)


def _check_lengths(prompt_len: int, max_new_tokens: int) -> None:
    if prompt_len < 1 or max_new_tokens < 1:
        raise ValueError(f"prompt_len={prompt_len} and max_new_tokens={max_new_tokens} must be >= 1")


@dataclass(frozen=True)
class RolloutMemory:
    weight_bytes: int
    kv_pool_bytes: int  # what SGLang's static memory leaves for the KV pool (and our query rings)
    kv_bytes_per_token: int
    peak_slots: int  # per request, in its fullest layer
    bytes_per_request: int  # its peak KV, plus its query ring when compressing
    max_requests: int  # requests whose peak fits the pool at once

    @property
    def kv_pool_tokens(self) -> int:
        return self.kv_pool_bytes // self.kv_bytes_per_token


def plan_rollout(shape: ModelShape, *, gpu_bytes: int, mem_fraction_static: float, dtype_bytes: int,
                 prompt_len: int, max_new_tokens: int, kv: KVCompressConfig | None,
                 engine: str = "sglang") -> RolloutMemory:
    """One TP-1 server keeping `mem_fraction_static` of the GPU for weights + KV pool: SGLang, or (engine "paged")
    a paged engine with per-layer pages, the one per-layer budgets need."""
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1], got {mem_fraction_static}")
    weights = shape.num_parameters() * dtype_bytes
    pool = int(gpu_bytes * mem_fraction_static) - weights
    if pool <= 0:
        raise ValueError(f"the weights ({weights / GIB:.1f} GiB) do not fit in {mem_fraction_static} of "
                         f"{gpu_bytes / GIB:.1f} GiB")
    per_token = shape.kv_bytes_per_token(dtype_bytes)
    if engine == "paged":
        peak = max(layer_peak_slots(prompt_len, max_new_tokens, kv, shape.num_layers))
    else:
        peak = peak_kv_slots(prompt_len, max_new_tokens, kv, engine)
    per_request = peak_kv_bytes(shape, prompt_len, max_new_tokens, kv, dtype_bytes, engine)
    if kv is not None and kv.enabled:
        per_request += shape.query_ring_bytes(kv.window, dtype_bytes)
    return RolloutMemory(weights, pool, per_token, peak, per_request, pool // per_request)


@dataclass(frozen=True)
class LearnerMemory:
    tp: int
    pp: int
    dp: int
    bytes_per_gpu: int  # weights + gradients + optimizer (+ frozen reference), activations excluded


def plan_learner(shape: ModelShape, *, tp: int, pp: int, dp: int, with_ref: bool = False) -> LearnerMemory:
    """Megatron, bf16 weights, fp32 gradients, distributed optimizer (fp32 master + Adam m, v sharded over DP)."""
    if min(tp, pp, dp) < 1:
        raise ValueError(f"tp, pp and dp must be >= 1, got {tp}, {pp}, {dp}")
    per_rank_params = math.ceil(shape.num_parameters() / (tp * pp))
    per_param = 2 + 4 + 12 / dp + (2 if with_ref else 0)
    return LearnerMemory(tp, pp, dp, int(per_rank_params * per_param))
