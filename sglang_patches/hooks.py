"""The hook functions, with the signatures SGLang's HookRegistry calls them with, and the table that places them.

HookRegistry conventions (sglang/srt/plugins/hook_registry.py): AFTER hooks get (result, *args, **kwargs) and may
return a replacement result (None keeps it); AROUND hooks get (original_fn, *args, **kwargs). For methods, args[0]
is the instance (the class, for the classmethod ForwardBatch.init_new).

Every hook is a no-op when this process has no SparseKVRuntime (compression off, or a process without a
ModelRunner such as the tokenizer manager).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .admission import new_request_decode_reservation, running_request_need, slots_freed_by_next_compaction
from .preconditions import SparseKVPreconditionError, check_model_runner, check_server_args, raise_if_problems
from .runtime import SparseKVRuntime, reset_request, wants_dense
from .settings import config_from_environ
from .version import SGLANG_VERSION

_runtime: SparseKVRuntime | None = None


def get_runtime() -> SparseKVRuntime | None:
    return _runtime


def set_runtime(runtime: SparseKVRuntime | None) -> None:
    global _runtime
    _runtime = runtime


# ------------------------------------------------------------------------------------------------------------------
# Start-up: refuse unsupported configurations, allocate the query rings
# ------------------------------------------------------------------------------------------------------------------
def after_server_args_post_init(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """ServerArgs.__post_init__ (AFTER): fail in the launching process, before any worker starts."""
    verify_hooks_applied()
    raise_if_problems(check_server_args(server_args), "server arguments")


def after_alloc_memory_pool(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> None:
    """ModelRunner.alloc_memory_pool (AFTER): check the loaded model and pools, then build this process's runtime.

    Runs before CUDA-graph capture, so the rings exist (at fixed addresses) when the decode graph records the
    capture writes. They live in the KV-cache memory-saver region, released and resumed with the KV cache.
    """
    cfg = config_from_environ()
    if cfg is None:
        return
    verify_hooks_applied()
    raise_if_problems(check_model_runner(model_runner), "scheduler process")
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    saver = TorchMemorySaverAdapter.create(enable=model_runner.server_args.enable_memory_saver)
    set_runtime(
        SparseKVRuntime.allocate(
            cfg,
            model_runner.req_to_token_pool,
            model_runner.token_to_kv_pool,
            model_runner.token_to_kv_pool_allocator,
            num_q_heads=model_runner.model_config.num_attention_heads,  # TP 1 (precondition): all heads local
            dtype=model_runner.dtype,
            memory_region=saver.region(GPU_MEMORY_TYPE_KV_CACHE),
        )
    )


# ------------------------------------------------------------------------------------------------------------------
# Serving
# ------------------------------------------------------------------------------------------------------------------
def around_radix_attention_forward(
    original: Callable, layer: Any, q: Any, k: Any, v: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> Any:
    """RadixAttention.forward (AROUND): q arrives post-RoPE; keep the last `window` of them per request."""
    runtime = _runtime
    if runtime is not None:
        runtime.capture_queries(layer.layer_id - getattr(runtime.kv_pool, "start_layer", 0), q, forward_batch)
    return original(layer, q, k, v, forward_batch, *args, **kwargs)


def around_prepare_for_decode(original: Callable, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """ScheduleBatch.prepare_for_decode (AROUND): compact before SGLang allocates the next slot at seq_lens.

    SGLang then writes the new token's slot at req_to_token[row, seq_len] and adds 1 to seq_lens / seq_lens_cpu /
    kv_committed_len / kv_allocated_len, all of which we have just shrunk consistently.
    """
    runtime = _runtime
    if runtime is None or not batch.spec_algorithm.is_none():
        return original(batch, *args, **kwargs)
    runtime.compact_batch(batch)
    result = original(batch, *args, **kwargs)
    runtime.record_kept(batch)
    return result


def after_forward_batch_init_new(result: Any, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """ForwardBatch.init_new (AFTER): decode positions = seq_lens - 1 + evicted, the token's logical index."""
    runtime = _runtime
    if runtime is not None and result.forward_mode.is_decode():
        result.positions = runtime.logical_decode_positions(result.positions, batch.reqs)
    return result


def after_flush_cache(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Scheduler.flush_cache (AFTER): a successful flush means no request is alive; clear the rings."""
    runtime = _runtime
    if runtime is not None and result:
        runtime.reset()


def after_reset_for_retract(result: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """Req.reset_for_retract (AFTER): the request is re-prefilled densely, so nothing is evicted any more."""
    reset_request(req)


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
    runtime = _runtime
    if runtime is None or wants_dense(req):
        return reserved
    need = running_request_need(req, runtime.cfg, dense=False)
    return reserved if need is None else min(reserved, need)


def _new_request_credit(adder: Any, req: Any) -> int:
    """How much less than SGLang's min(max_new_tokens, CLIP) a waiting request needs to reserve for its decode."""
    runtime = _runtime
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
    runtime = _runtime
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
    HookSpec("sglang.srt.server_args.ServerArgs.__post_init__", after_server_args_post_init, "AFTER"),
    HookSpec("sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool", after_alloc_memory_pool, "AFTER"),
    HookSpec("sglang.srt.layers.radix_attention.RadixAttention.forward", around_radix_attention_forward, "AROUND"),
    HookSpec("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode", around_prepare_for_decode, "AROUND"),
    HookSpec("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", after_forward_batch_init_new, "AFTER"),
    HookSpec("sglang.srt.managers.scheduler.Scheduler.flush_cache", after_flush_cache, "AFTER"),
    HookSpec("sglang.srt.managers.schedule_batch.Req.reset_for_retract", after_reset_for_retract, "AFTER"),
    HookSpec("sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset",
             around_running_request_offset, "AROUND"),
    HookSpec("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", around_add_one_req, "AROUND"),
    HookSpec("sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req", around_add_chunked_req, "AROUND"),
    HookSpec("sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem", around_check_decode_mem, "AROUND"),
)


def verify_hooks_applied() -> None:
    """Raise if HookRegistry could not apply one of our hooks (apply_hooks only logs such failures).

    A missing hook would silently serve dense or, worse, half-patched generation; the start-up hooks call this
    in every process, after load_plugins() has applied the hooks.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [spec.target for spec in HOOKS if spec.target not in HookRegistry._patched]
    if missing:
        raise SparseKVPreconditionError(
            f"slime_sparse hooks were not applied to {missing}: the installed SGLang does not match "
            f"{SGLANG_VERSION} (see the log of HookRegistry.apply_hooks and `python -m sglang_patches.contract`)"
        )
