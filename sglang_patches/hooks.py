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

from .preconditions import SparseKVPreconditionError, check_model_runner, check_server_args, raise_if_problems
from .runtime import SparseKVRuntime, reset_request
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
