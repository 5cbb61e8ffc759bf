"""The hook functions, with the signatures SGLang's HookRegistry calls them with, and the table that places them.

HookRegistry conventions (sglang/srt/plugins/hook_registry.py): AFTER hooks get (result, *args, **kwargs) and may
return a replacement result (None keeps it); AROUND hooks get (original_fn, *args, **kwargs). For methods, args[0]
is the instance (the class, for the classmethod ForwardBatch.init_new).

No module state: each hook finds this process's SparseKVRuntime on an object SGLang hands it (the batch's, the
adder's tree cache's or the model runner's ReqToTokenPool; the attention layer's own ring) and passes through when
there is none (compression off, or a process without a ModelRunner such as the tokenizer manager).
"""
from __future__ import annotations

import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .admission import new_request_decode_reservation, running_request_need, slots_freed_by_next_compaction
from .preconditions import SparseKVPreconditionError, check_model_runner, raise_if_problems
from .runtime import RING_ATTR, SparseKVRuntime, capture_queries, runtime_of, wants_dense
from .settings import config_from_environ
from .version import SGLANG_VERSION


# ------------------------------------------------------------------------------------------------------------------
# Start-up: refuse unsupported configurations, allocate the query rings
# ------------------------------------------------------------------------------------------------------------------
def after_alloc_memory_pool(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> None:
    """ModelRunner.alloc_memory_pool (AFTER): check flags, model and pools, then build this process's runtime.

    Runs in each scheduler process after the model is loaded and before CUDA-graph capture, so the rings exist (at
    fixed addresses) when the decode graph records the capture writes. They live in the KV-cache memory-saver region,
    released and resumed with the KV cache.
    """
    cfg = config_from_environ()
    if cfg is None:
        return
    verify_hooks_applied()
    raise_if_problems(check_model_runner(model_runner), "scheduler process")
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    saver = TorchMemorySaverAdapter.create(enable=model_runner.server_args.enable_memory_saver)
    runtime = SparseKVRuntime.allocate(
        cfg,
        model_runner.req_to_token_pool,
        model_runner.token_to_kv_pool,
        model_runner.token_to_kv_pool_allocator,
        num_q_heads=model_runner.model_config.num_attention_heads,  # TP 1 (precondition): all heads local
        dtype=model_runner.dtype,
        memory_region=saver.region(GPU_MEMORY_TYPE_KV_CACHE),
    )
    runtime.attach(m for m in model_runner.model.modules() if isinstance(m, RadixAttention))


# ------------------------------------------------------------------------------------------------------------------
# Serving
# ------------------------------------------------------------------------------------------------------------------
def around_radix_attention_forward(
    original: Callable, layer: Any, q: Any, k: Any, v: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> Any:
    """RadixAttention.forward (AROUND): q arrives post-RoPE; keep the last `window` of them per request."""
    ring = getattr(layer, RING_ATTR, None)
    if ring is not None:
        capture_queries(ring, q, forward_batch)
    return original(layer, q, k, v, forward_batch, *args, **kwargs)


def around_prepare_for_decode(original: Callable, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """ScheduleBatch.prepare_for_decode (AROUND): compact before SGLang allocates the next slot at seq_lens.

    SGLang then writes the new token's slot at req_to_token[row, seq_len] and adds 1 to seq_lens / seq_lens_cpu /
    kv_committed_len / kv_allocated_len, all of which we have just shrunk consistently. This runs in the scheduler,
    before the forward, so the compaction is never inside a captured CUDA graph: the graph replays with the page
    table SGLang's backend rebuilds from the compacted req_to_token (sglang_patches/README.md, CUDA graphs).
    """
    runtime = runtime_of(batch.req_to_token_pool)
    if runtime is None or not batch.spec_algorithm.is_none():
        return original(batch, *args, **kwargs)
    runtime.compact_batch(batch)
    result = original(batch, *args, **kwargs)
    runtime.record_kept(batch)
    return result


def after_forward_batch_init_new(result: Any, cls: Any, batch: Any, model_runner: Any, *args: Any,
                                 **kwargs: Any) -> Any:
    """ForwardBatch.init_new (AFTER): decode positions = seq_lens - 1 + evicted, the token's logical index; an
    extend batch restarts any retracted request dense (the only way a request that evicted tokens is prefilled)."""
    runtime = runtime_of(model_runner.req_to_token_pool)
    if runtime is None:
        return result
    if result.forward_mode.is_decode():
        result.positions = runtime.logical_decode_positions(result.positions, batch.reqs)
    elif result.forward_mode.is_extend():
        runtime.start_prefill(batch.reqs)
    return result


# ------------------------------------------------------------------------------------------------------------------
# Admission control: reserve what a compressed request can still need, not its dense remaining tokens
# (numbers in sglang_patches.admission; dense-opted-out requests keep SGLang's reservation untouched)
# ------------------------------------------------------------------------------------------------------------------
def around_running_request_offset(original: Callable, adder: Any, req: Any, *args: Any, **kwargs: Any) -> float:
    """PrefillAdder._get_running_request_total_token_offset (AROUND): a running request's reservation.

    SGLang reserves min(max_new_tokens - generated, CLIP) * new_token_ratio. A compressed request never grows past
    its budget peak, so it reserves min(that, remaining_slot_need): the bound can only lower the reservation, and
    the ratio / CLIP estimate still applies when it is the smaller. The same method prices a preempted request
    (preempt_to_schedule), so preemption accounting stays consistent.
    """
    reserved = original(adder, req, *args, **kwargs)
    runtime = runtime_of(adder.tree_cache.req_to_token_pool)
    if runtime is None or wants_dense(req):
        return reserved
    need = running_request_need(req, runtime.cfg, dense=False)
    return reserved if need is None else min(reserved, need)


def _new_request_credit(adder: Any, req: Any) -> int:
    """How much less than SGLang's min(max_new_tokens, CLIP) a waiting request needs to reserve for its decode."""
    runtime = runtime_of(adder.tree_cache.req_to_token_pool)
    if runtime is None or wants_dense(req) or adder.dllm_config is not None:  # dLLM reserves no decode tokens
        return 0
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    sglang_reserved = min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS)
    return max(0, sglang_reserved - new_request_decode_reservation(req, runtime.cfg, dense=False))


def around_add_one_req(original: Callable, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """PrefillAdder.add_one_req (AROUND): admit a compressed request on its budget-bounded reservation.

    add_one_req both tests `prompt + min(max_new_tokens, CLIP) < rem_total_tokens` and, on success, adds that
    amount to rem_total_token_offset (through _update_prefill_budget). Lowering the offset by the credit first makes
    both use prompt + our bound, without copying SGLang's admission logic. The credit is kept only if the whole
    prompt was admitted (SGLang then reserved the decode tokens); a refused request or a first chunk (which reserves
    no decode tokens) gives it back, and a chunk's budget state is recomputed without it.
    """
    credit = _new_request_credit(adder, req)
    if credit == 0:
        return original(adder, req, *args, **kwargs)
    admitted_before = len(adder.can_run_list)
    adder.rem_total_token_offset -= credit
    result = original(adder, req, *args, **kwargs)
    admitted = len(adder.can_run_list) > admitted_before
    if not admitted or adder.new_chunked_req is req:
        adder.rem_total_token_offset += credit
        if admitted:
            result = adder.budget_state()
    return result


def around_add_chunked_req(original: Callable, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """PrefillAdder.add_chunked_req (AROUND): the last chunk of a prompt reserves the budget bound.

    SGLang reserves min(max_new_tokens, CLIP) only when this chunk completes the prompt (it returns None then).
    The credit is applied after the call, so the chunk length SGLang chooses from rem_total_tokens is unchanged.
    """
    result = original(adder, req, *args, **kwargs)
    if result is None:
        adder.rem_total_token_offset -= _new_request_credit(adder, req)
    return result


def around_check_decode_mem(original: Callable, batch: Any, selected_indices: list[int] | None = None) -> bool:
    """ScheduleBatch.check_decode_mem (AROUND): count the slots our compaction frees before the next allocation.

    SGLang retracts requests when the free pool cannot hold one new slot per request. Our prepare_for_decode hook
    compacts every request at its trigger before SGLang allocates, so those slots are free by then. Without this,
    a pool filled to the budget peaks that admission now allows would retract requests (dense re-prefill) exactly
    when compaction was about to make room. retract_decode re-checks through this method, so it retracts only
    what is really short.
    """
    if original(batch, selected_indices=selected_indices):
        return True
    runtime = runtime_of(batch.req_to_token_pool)
    if runtime is None or not batch.spec_algorithm.is_none():
        return False
    reqs = batch.reqs if selected_indices is None else [batch.reqs[i] for i in selected_indices]
    freed = sum(slots_freed_by_next_compaction(r.kv_committed_len, len(r.output_ids), runtime.cfg, wants_dense(r))
                for r in reqs)
    needed = batch.new_tokens_required_next_decode(selected_indices)
    return batch.token_to_kv_pool_allocator.available_size() + freed >= needed


# ------------------------------------------------------------------------------------------------------------------
# Where each hook goes (targets are checked against the pinned source by sglang_patches.contract)
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HookSpec:
    target: str  # dotted path, as HookRegistry.register expects
    hook: Callable
    hook_type: str  # name of a sglang.srt.plugins.hook_registry.HookType member


HOOKS: tuple[HookSpec, ...] = (
    HookSpec("sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool", after_alloc_memory_pool, "AFTER"),
    HookSpec("sglang.srt.layers.radix_attention.RadixAttention.forward", around_radix_attention_forward, "AROUND"),
    HookSpec("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode", around_prepare_for_decode, "AROUND"),
    HookSpec("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", after_forward_batch_init_new, "AFTER"),
    HookSpec("sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset",
             around_running_request_offset, "AROUND"),
    HookSpec("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", around_add_one_req, "AROUND"),
    HookSpec("sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req", around_add_chunked_req, "AROUND"),
    HookSpec("sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem", around_check_decode_mem, "AROUND"),
)


def hook_installed(spec: HookSpec) -> bool:
    """The attribute SGLang calls at spec.target runs spec.hook: one of the wrappers HookRegistry chained in front
    of the original (each `__wrapped__` by the next, our hook among its closure's values) is ours."""
    owner, name = spec.target.rsplit(".", 1)
    attr = inspect.getattr_static(pkgutil.resolve_name(owner), name, None)
    fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
    while fn is not None:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is spec.hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def verify_hooks_applied() -> None:
    """Raise if one of our hooks is not in place (HookRegistry.apply_hooks only logs a target it cannot patch).

    A missing hook would silently serve dense or, worse, half-patched generation; the start-up hook calls this in
    every scheduler process, after load_plugins() has applied the hooks.
    """
    missing = [spec.target for spec in HOOKS if not hook_installed(spec)]
    if missing:
        raise SparseKVPreconditionError(
            f"slime_sparse hooks were not applied to {missing}: the installed SGLang does not match "
            f"{SGLANG_VERSION} (see the log of HookRegistry.apply_hooks and `python -m sglang_patches.contract`)"
        )
