"""What must hold for req_to_token compaction to be correct; checked before SGLang serves anything.

Two checks, both duck-typed (getattr on SGLang's objects, so tests drive them with plain namespaces), run in each
scheduler process by the ModelRunner.alloc_memory_pool hook, before the server serves anything (our launcher passes
the flags they ask for, slime_sparse/rollout/sglang/launch.py):
- check_server_args: flags, as resolved by the scheduler;
- check_model_runner: those, and what only the loaded model and its pools reveal (attention type, pool classes,
  layout).
Each returns a list of human-readable problems; `raise_if_problems` turns them into one clear error.
"""
from __future__ import annotations

from typing import Any

# Backends that read a request's KV through req_to_token[row, :seq_len] with page_size 1 (so a compacted row
# and a shrunk seq_len are all they see). trtllm_mha / aiter / MLA backends are paged or layout-specific.
SUPPORTED_ATTENTION_BACKENDS = ("fa3", "flashinfer", "triton", "torch_native")
# Decode CUDA graphs: our query capture uses fixed-shape indexing only, so a full graph records it.
SUPPORTED_DECODE_GRAPH_BACKENDS = ("full", "disabled")


class SparseKVPreconditionError(RuntimeError):
    """SGLang is configured in a way the budgeted KV cache cannot support."""


def _flag_problems(args: Any) -> list[str]:
    # (attribute, bad predicate, message): messages name the SGLang flag to change.
    rules: list[tuple[str, Any, str]] = [
        ("page_size", lambda v: v != 1,
         "needs --page-size 1 (compaction moves single token slots)"),
        ("disable_radix_cache", lambda v: not v,
         "needs --disable-radix-cache (evicting shared prefix slots would corrupt other requests)"),
        ("disable_overlap_schedule", lambda v: not v,
         "needs --disable-overlap-schedule (the overlap scheduler prepares step t+1 before step t's lengths "
         "are final)"),
        ("enable_mixed_chunk", bool,
         "needs --enable-mixed-chunk off (mixed prefill/decode batches bypass the decode hooks)"),
        ("speculative_algorithm", lambda v: v is not None,
         "needs speculative decoding off (it owns decode preparation)"),
        ("tp_size", lambda v: v != 1,
         "needs --tp-size 1 (each TP rank would select from its own heads; scale out with --dp-size or several "
         "servers behind the router)"),
        ("pp_size", lambda v: v != 1, "needs --pp-size 1 (one selection must see every layer)"),
        ("enable_dp_attention", bool, "needs --enable-dp-attention off"),
        ("enable_torch_compile", bool,
         "needs --enable-torch-compile off (query capture must run eagerly or in a full CUDA graph)"),
        ("enable_hierarchical_cache", bool, "needs --enable-hierarchical-cache off"),
        ("enable_hisparse", bool, "needs --enable-hisparse off"),
        ("enable_unified_memory", bool, "needs --enable-unified-memory off"),
        ("enable_page_major_kv_layout", bool,
         "needs --enable-page-major-kv-layout off (keys are read per slot in NHD layout)"),
        ("strip_thinking_cache", bool,
         "needs --strip-thinking-cache off (it frees generated tokens by their logical range)"),
        ("is_embedding", bool, "serves generation only (not --is-embedding)"),
        ("kv_cache_dtype", lambda v: str(v).startswith(("fp8", "fp4")),
         "needs a 16/32-bit KV cache, e.g. --kv-cache-dtype auto (scores read the stored keys as plain floats)"),
        ("disaggregation_mode", lambda v: v not in ("null", None), "needs --disaggregation-mode null"),
        ("attention_backend", lambda v: v is not None and v not in SUPPORTED_ATTENTION_BACKENDS,
         f"needs --attention-backend in {SUPPORTED_ATTENTION_BACKENDS}"),
    ]
    problems = []
    for attr, is_bad, message in rules:
        if hasattr(args, attr) and is_bad(getattr(args, attr)):
            problems.append(f"{message}; got {attr}={getattr(args, attr)!r}")
    return problems


def _graph_problems(args: Any) -> list[str]:
    graphs = getattr(args, "cuda_graph_config", None)
    if graphs is None:
        return []
    problems = []
    prefill = getattr(getattr(graphs, "prefill", None), "backend", None)
    if prefill is not None and prefill != "disabled":
        problems.append(
            "needs --cuda-graph-backend-prefill disabled (prefill graphs trace attention through torch.compile, "
            f"where the data-dependent query capture cannot run); got prefill backend {prefill!r}"
        )
    decode = getattr(getattr(graphs, "decode", None), "backend", None)
    if decode is not None and decode not in SUPPORTED_DECODE_GRAPH_BACKENDS:
        problems.append(
            f"needs a decode CUDA graph backend in {SUPPORTED_DECODE_GRAPH_BACKENDS} "
            f"(--cuda-graph-backend-decode); got {decode!r}"
        )
    return problems


def check_server_args(args: Any) -> list[str]:
    """Problems with SGLang's ServerArgs (empty list = supported)."""
    return _flag_problems(args) + _graph_problems(args)


def check_model_runner(model_runner: Any) -> list[str]:
    """Problems only visible once the model and its pools exist (empty list = supported)."""
    problems = check_server_args(model_runner.server_args)
    backend = getattr(model_runner.server_args, "attention_backend", None)
    if backend not in SUPPORTED_ATTENTION_BACKENDS:
        problems.append(f"needs an attention backend in {SUPPORTED_ATTENTION_BACKENDS}; resolved to {backend!r}")
    arch = getattr(getattr(model_runner.model_config, "attention_arch", None), "name", None)
    if arch != "MHA":
        problems.append(f"supports MHA/GQA attention only; the model's attention architecture is {arch!r}")
    if getattr(model_runner, "is_hybrid_swa", False):
        problems.append("does not support hybrid sliding-window models (two KV pools)")
    if getattr(model_runner, "mambaish_config", None) is not None:
        problems.append("does not support hybrid linear-attention / Mamba models")
    if getattr(model_runner, "model_is_mrope", False):
        problems.append("does not support M-RoPE models (positions are not one index per token)")
    if getattr(model_runner, "is_draft_worker", False):
        problems.append("does not run in a speculative draft worker")
    expected = {
        "req_to_token_pool": "ReqToTokenPool",
        "token_to_kv_pool": "MHATokenToKVPool",
        "token_to_kv_pool_allocator": "TokenToKVPoolAllocator",
    }
    for attr, cls_name in expected.items():
        got = type(getattr(model_runner, attr, None)).__name__
        if got != cls_name:
            problems.append(f"needs model_runner.{attr} to be SGLang's {cls_name}; got {got}")
    pool = getattr(model_runner, "token_to_kv_pool", None)
    if pool is not None:
        layout = getattr(pool, "kv_cache_layout", "nhd")
        if layout != "nhd":
            problems.append(f"needs the NHD KV layout (unset SGLANG_USE_HND_KVCACHE); got {layout!r}")
        if getattr(pool, "store_dtype", None) != getattr(pool, "dtype", None):
            problems.append("needs the KV cache stored in the model dtype (no fp8 KV cache)")
    return problems


def raise_if_problems(problems: list[str], where: str) -> None:
    if problems:
        lines = "\n  - ".join(problems)
        raise SparseKVPreconditionError(
            f"slime_sparse budgeted KV cache refuses to start ({where}): SGLang\n  - {lines}\n"
            "Unset SLIME_SPARSE_KV_CONFIG (or use --kv-method none) to run SGLang unpatched."
        )
