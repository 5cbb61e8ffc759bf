"""What our hooks assume about SGLang's source, written down so it can be checked without a GPU.

Each SourceCheck names a symbol in the SGLang package (file + dotted name inside it) and what must be there:
`names` that the symbol defines (methods, annotated fields, `self.x =` attributes) and `snippets` of code that our
logic depends on (compared with all whitespace removed). The checks parse the source with `ast`; nothing of
SGLang is imported, so they run against an unpacked wheel on any machine.

    python -m sglang_patches.contract                  # the installed sglang
    python -m sglang_patches.contract --source DIR     # an unpacked wheel (DIR contains sglang/)
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .hooks import HOOKS
from .version import SGLANG_VERSION


@dataclass(frozen=True)
class SourceCheck:
    path: str  # file inside the sglang package, e.g. "srt/managers/schedule_batch.py"
    symbol: str  # dotted name inside the file ("" = the module itself)
    why: str  # which of our assumptions this guards
    names: tuple[str, ...] = ()
    snippets: tuple[str, ...] = ()

    @property
    def dotted(self) -> str:
        module = "sglang." + self.path.removesuffix(".py").replace("/", ".")
        return f"{module}.{self.symbol}" if self.symbol else module


SB = "srt/managers/schedule_batch.py"
SP = "srt/managers/schedule_policy.py"
CHECKS: tuple[SourceCheck, ...] = (
    # --- plugin mechanism -------------------------------------------------------------------------------------
    SourceCheck("srt/plugins/__init__.py", "", "entry-point group our setup.py declares",
                names=("load_plugins",), snippets=('GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"',)),
    SourceCheck("srt/plugins/__init__.py", "load_plugins", "plugins run, then hooks are applied",
                snippets=("func()", "HookRegistry.apply_hooks()")),
    SourceCheck("srt/plugins/hook_registry.py", "HookRegistry", "registration API and the applied-target set",
                names=("register", "apply_hooks", "_patched"), snippets=("cls._patched.add(target)",)),
    SourceCheck("srt/plugins/hook_registry.py", "HookType", "hook kinds we use",
                names=("AFTER", "AROUND")),
    SourceCheck("srt/plugins/hook_registry.py", "HookRegistry._apply_target", "classmethod targets stay classmethods",
                snippets=("isinstance(raw_attr, classmethod)", "wrapped = classmethod(wrapped)")),
    SourceCheck("srt/plugins/hook_registry.py", "_wrap_fn", "AFTER/AROUND calling conventions of our hooks",
                snippets=("modified = hook(result, *args, **kwargs)", "return hook(original_fn, *args, **kwargs)")),
    SourceCheck("srt/managers/scheduler.py", "run_scheduler_process", "hooks exist in every scheduler process",
                snippets=("load_plugins()",)),
    # --- start-up checks --------------------------------------------------------------------------------------
    SourceCheck("srt/server_args.py", "ServerArgs", "flags read by preconditions.check_server_args",
                names=("__post_init__", "page_size", "disable_radix_cache", "disable_overlap_schedule",
                       "enable_mixed_chunk", "speculative_algorithm", "tp_size", "pp_size", "enable_dp_attention",
                       "enable_torch_compile", "enable_hierarchical_cache", "enable_hisparse", "enable_unified_memory",
                       "enable_page_major_kv_layout", "strip_thinking_cache", "is_embedding", "kv_cache_dtype",
                       "disaggregation_mode", "attention_backend", "cuda_graph_config", "enable_memory_saver",
                       "skip_tokenizer_init", "load_format")),
    SourceCheck("srt/model_executor/cuda_graph_config.py", "CudaGraphConfig", "per-phase graph backends",
                names=("decode", "prefill")),
    SourceCheck("srt/model_executor/cuda_graph_config.py", "Backend", "graph backend names",
                snippets=('FULL = "full"', 'DISABLED = "disabled"')),
    SourceCheck("srt/model_executor/model_runner.py", "ModelRunner.alloc_memory_pool",
                "pools exist after it and before CUDA-graph capture", snippets=("self.init_memory_pool(",)),
    SourceCheck("srt/model_executor/model_runner.py", "ModelRunner", "attributes read by check_model_runner",
                names=("server_args", "model_config", "is_hybrid_swa", "model_is_mrope", "is_draft_worker",
                       "mambaish_config", "dtype", "req_to_token_pool", "token_to_kv_pool_allocator")),
    SourceCheck("srt/model_executor/model_runner_kv_cache_mixin.py", "ModelRunnerKVCacheMixin._init_pools",
                "the KV pool attribute and its class", names=(),
                snippets=("self.token_to_kv_pool = ", "mha_pool_class = (")),
    SourceCheck("srt/configs/model_config.py", "AttentionArch", "MHA vs MLA", names=("MHA", "MLA")),
    SourceCheck("srt/configs/model_config.py", "ModelConfig", "query heads for the rings",
                names=("num_attention_heads", "attention_arch")),
    # --- pools (layout compaction relies on) ------------------------------------------------------------------
    SourceCheck("srt/mem_cache/memory_pool.py", "ReqToTokenPool.__init__", "int32 rows, row 0 is padding",
                snippets=("self._alloc_size = size + 1", "(self._alloc_size, max_context_len), dtype=torch.int32",
                          "self.free_slots = list(range(1, self._alloc_size))")),
    SourceCheck("srt/mem_cache/memory_pool.py", "KVCache.__init__", "dtype, store dtype and first layer",
                snippets=("self.store_dtype = dtype", "self.start_layer = start_layer or 0",
                          "self.layer_num = layer_num")),
    SourceCheck("srt/mem_cache/memory_pool.py", "MHATokenToKVPool._create_buffers",
                "per-layer NHD key buffers with a padding slot",
                snippets=("(self.size + self.page_size, self.head_num, self.head_dim)",)),
    SourceCheck("srt/mem_cache/memory_pool.py", "MHATokenToKVPool", "key access and layout label",
                names=("get_key_buffer", "head_dim", "head_num", "kv_cache_layout")),
    SourceCheck("srt/mem_cache/allocator/token.py", "TokenToKVPoolAllocator", "free list of page_size 1",
                names=("alloc", "free", "clear", "available_size"),
                snippets=("torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)",
                          "self.free_pages = torch.cat((self.free_pages, free_index))")),
    # --- decode step: compaction, allocation, positions -------------------------------------------------------
    SourceCheck(SB, "ScheduleBatch", "batch fields compaction rewrites",
                names=("reqs", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "spec_algorithm", "req_to_token_pool",
                       "prepare_for_decode")),
    SourceCheck(SB, "ScheduleBatch.prepare_for_decode", "next slot allocated at seq_lens; all lengths +1",
                snippets=("spec_prepare_for_decode(self)", "self.out_cache_loc = alloc_for_decode(self, token_per_req=1)",
                          "req.kv_committed_len += 1", "req.kv_allocated_len += 1", "self.seq_lens.add_(1)",
                          "self.seq_lens_cpu.add_(1)", "self.seq_lens_sum = None")),
    SourceCheck("srt/mem_cache/common.py", "alloc_for_decode", "new slot written at req_to_token[row, seq_len]",
                snippets=("alloc_token_slots(batch.tree_cache, bs * token_per_req)", "locs = seq_lens_gpu.clone()",
                          "batch.req_to_token_pool.write((batch.req_pool_indices, locs), "
                          "out_cache_loc.to(torch.int32))")),
    SourceCheck(SB, "Req", "per-request fields we read and shrink",
                names=("rid", "origin_input_ids", "output_ids", "req_pool_idx", "kv_committed_len", "kv_allocated_len",
                       "customized_info", "reset_for_retract", "sampling_params")),
    SourceCheck(SB, "Req.reset_for_retract", "retraction restarts the request from a dense prefill",
                snippets=("self.kv_allocated_len = 0", "self.kv_committed_len = 0")),
    SourceCheck("srt/mem_cache/chunk_cache.py", "ChunkCache.cache_finished_req",
                "a finished request frees exactly req_to_token[row, :kv_committed_len]",
                snippets=("kv_committed_len = req.pop_committed_kv_cache()",
                          "self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_committed_len]",
                          "self.token_to_kv_pool_allocator.free(kv_indices)")),
    SourceCheck("srt/mem_cache/common.py", "release_kv_cache", "over-allocation range is empty for us",
                snippets=("start_p, end_p = req.pop_overallocated_kv_cache()",)),
    SourceCheck("srt/model_executor/forward_batch_info.py", "ForwardBatch.init_new",
                "decode positions come from the (compacted) seq_lens",
                snippets=("ret.positions = clamp_position(batch.seq_lens)", "seq_lens_cpu = batch.seq_lens_cpu",
                          "batch.seq_lens_sum = int(seq_lens_cpu.sum())")),
    SourceCheck("srt/model_executor/forward_batch_info.py", "ForwardBatch", "fields the query capture reads",
                names=("forward_mode", "req_pool_indices", "positions", "seq_lens", "extend_seq_lens")),
    SourceCheck("srt/model_executor/forward_batch_info.py", "ForwardMode", "modes the capture distinguishes",
                names=("is_decode", "is_extend", "is_idle")),
    SourceCheck("srt/layers/radix_attention.py", "RadixAttention.forward", "post-RoPE q, then the backend",
                snippets=("def forward(self, q, k, v, forward_batch: ForwardBatch, save_kv_cache: bool = True,",)),
    SourceCheck("srt/layers/radix_attention.py", "RadixAttention.__init__", "layer id and head layout",
                snippets=("self.tp_q_head_num = num_heads", "self.qk_head_dim = head_dim", "self.layer_id = layer_id")),
    SourceCheck("srt/managers/scheduler.py", "Scheduler.flush_cache", "flush empties both pools when idle",
                snippets=("self.req_to_token_pool.clear()", "self.token_to_kv_pool_allocator.clear()", "return success")),
    SourceCheck("srt/utils/torch_memory_saver_adapter.py", "TorchMemorySaverAdapter", "rings in the KV region",
                names=("create",)),
    SourceCheck("srt/constants.py", "", "memory-saver tag of the KV cache",
                snippets=('GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"',)),
    # --- admission control (hooks.around_running_request_offset / around_add_one_req / around_add_chunked_req /
    # around_check_decode_mem): where SGLang reserves memory for a request's future tokens -----------------------
    SourceCheck(SP, "", "the clip the dense part of a new request's reservation uses",
                snippets=("CLIP_MAX_NEW_TOKENS = int(",)),
    SourceCheck(SP, "PrefillAdder", "attributes and methods the admission hooks read or wrap",
                names=("_get_running_request_total_token_offset", "add_one_req", "add_one_req_ignore_eos",
                       "add_chunked_req", "budget_state", "preempt_to_schedule", "rem_total_token_offset",
                       "can_run_list", "new_chunked_req", "dllm_config", "new_token_ratio")),
    SourceCheck(SP, "PrefillAdder.__init__", "running requests are priced by the hooked method, summed into the offset",
                snippets=("self.rem_total_token_offset += sum([self._get_running_request_total_token_offset(r) "
                          "for r in running_batch.reqs])",)),
    SourceCheck(SP, "PrefillAdder._get_running_request_total_token_offset",
                "the dense reservation our bound may only lower (remaining tokens, clipped, times the ratio)",
                snippets=("(req.sampling_params.max_new_tokens - len(req.output_ids))", "CLIP_MAX_NEW_TOKENS",
                          "* self.new_token_ratio")),
    SourceCheck(SP, "PrefillAdder.rem_total_tokens", "the offset is subtracted from the free pool",
                snippets=("return available_and_evictable - self.rem_total_token_offset",)),
    SourceCheck(SP, "PrefillAdder._update_prefill_budget", "an admitted request adds prompt + max_new_tokens to the offset",
                snippets=("self.rem_total_token_offset += (extend_input_len + max_new_tokens + page_overhead "
                          "+ mamba_gap_reserve)",)),
    SourceCheck(SP, "PrefillAdder.add_one_req",
                "the admission test and the reservation both use rem_total_tokens and min(max_new_tokens, CLIP); "
                "a whole prompt is appended to can_run_list, a first chunk also becomes new_chunked_req",
                snippets=("return self.add_one_req_ignore_eos(req)", "if total_tokens >= self.rem_total_tokens:",
                          "min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS,)",
                          "self.can_run_list.append(req)", "self.new_chunked_req = req",
                          "return self.budget_state()")),
    SourceCheck(SP, "PrefillAdder.add_one_req_ignore_eos", "same reservation and chunk marking on the ignore_eos path",
                snippets=("min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS)",
                          "self.new_chunked_req = req", "return self.budget_state()")),
    SourceCheck(SP, "PrefillAdder.add_chunked_req", "only the last chunk (returns None) reserves the decode tokens",
                snippets=("min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS) if not truncated else 0",
                          "return req if truncated else None")),
    SourceCheck(SP, "PrefillAdder.preempt_to_schedule", "a preempted request gives back what the hooked method priced",
                snippets=("self.rem_total_token_offset -= (self._get_running_request_total_token_offset(running_req))",)),
    SourceCheck(SB, "ScheduleBatch", "decode-memory check and what it reads",
                names=("check_decode_mem", "new_tokens_required_next_decode", "retract_decode",
                       "token_to_kv_pool_allocator")),
    SourceCheck(SB, "ScheduleBatch.check_decode_mem", "one free slot per request is asked of the allocator",
                snippets=("num_tokens = self.new_tokens_required_next_decode(selected_indices)",
                          "return self.token_to_kv_pool_allocator.available_size() >= num_tokens")),
    SourceCheck(SB, "ScheduleBatch.retract_decode", "retraction re-checks through the hooked method",
                snippets=("not self.check_decode_mem(selected_indices=sorted_indices)",)),
    SourceCheck("srt/managers/scheduler.py", "Scheduler.update_running_batch",
                "the memory check runs before prepare_for_decode, where our compaction frees slots",
                snippets=("not batch.check_decode_mem()", "batch.prepare_for_decode()")),
    SourceCheck(SB, "ScheduleBatch.prepare_for_extend", "after a prefill, kv_committed_len = the prefilled length",
                snippets=("req.kv_committed_len = seq_len",)),
    SourceCheck(SB, "Req._refresh_fill_ids", "a (re)prefill covers origin_input_ids + output_ids",
                snippets=("full_untruncated_fill_ids == origin_input_ids + output_ids",)),
    # --- what comes back over HTTP ----------------------------------------------------------------------------
    SourceCheck("srt/managers/scheduler_components/output_streamer.py", "", "Req.customized_info streamed per token",
                snippets=("if req.customized_info is not None:", "req_values[send_token_offset : len(output_ids_)]")),
    SourceCheck("srt/managers/tokenizer_manager.py", "TokenizerManager._handle_batch_output",
                "customized_info and logprobs land in meta_info",
                snippets=("meta_info[k] = state.customized_info_accumulated[k]",
                          '"output_ids": state.output_ids.copy(),')),
    SourceCheck("srt/managers/tokenizer_manager.py", "TokenizerManager.detokenize_logprob_tokens",
                "logprob entries are (logprob, token_id, text)", snippets=("(logprob, token_id, None)",)),
    SourceCheck("srt/managers/tokenizer_manager.py", "TokenizerManager.add_logprob_to_meta_info",
                "output_token_logprobs key",
                snippets=('meta_info["output_token_logprobs"] = state.output_token_logprobs',)),
    SourceCheck(SB, "FINISH_LENGTH.to_json", "finish reason types", snippets=('"type": "length"',)),
    SourceCheck(SB, "FINISH_MATCHED_TOKEN.to_json", "finish reason types", snippets=('"type": "stop"',)),
    SourceCheck("srt/managers/io_struct.py", "GenerateReqInput", "what the client sends",
                names=("input_ids", "sampling_params", "return_logprob", "rid")),
    SourceCheck("srt/sampling/sampling_params.py", "SamplingParams", "sampling fields the client sends",
                names=("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos",
                       "sampling_seed", "custom_params")),
    SourceCheck(SB, "Req.__init__", "custom_params reach the scheduler as Req.sampling_params.custom_params "
                "(the per-request dense opt-out)",
                snippets=("sampling_params.custom_params = sampling_params.custom_params | {",
                          "self.sampling_params = sampling_params")),
    SourceCheck("srt/managers/io_struct.py", "UpdateWeightsFromDistributedReqInput", "weight broadcast request",
                names=("names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version", "load_format")),
    SourceCheck("srt/model_executor/model_runner.py", "ModelRunner.update_weights_from_distributed",
                "one broadcast per bucket in the flattened layout weight_sync.flat_plan packs",
                snippets=('if load_format == "flattened_bucket":',
                          "return self._update_bucketed_weights_from_distributed(")),
    SourceCheck("srt/model_executor/model_runner.py", "ModelRunner._update_bucketed_weights_from_distributed",
                "the bucket is received from rank 0 into FlattenedTensorBucket's buffer",
                snippets=("bucket = FlattenedTensorBucket(named_tensors=named_tensors)",
                          "torch.distributed.broadcast(flattened_tensor, src=0, "
                          "group=self._model_update_group[group_name],)")),
    SourceCheck("srt/weight_sync/tensor_bucket.py", "FlattenedTensorBucket.__init__",
                "tensors' bytes back to back, no padding (what weight_sync.flat_plan / pack produce)",
                snippets=("flattened = tensor.flatten().view(torch.uint8)", "current_idx += numel",
                          "self.flattened_tensor = torch.cat(flattened_tensors, dim=0)")),
    SourceCheck("srt/model_executor/model_runner.py", "ModelRunner.init_weights_update_group",
                "server rank = rank_offset (TP 1), group joined with init_custom_process_group",
                snippets=("rank = rank_offset + self.tp_rank", "init_custom_process_group(")),
    SourceCheck("srt/managers/tp_worker.py", "BaseTpWorker.update_weights_from_tensor",
                "tensor hand-off payload: one MultiprocessingSerializer payload per TP rank",
                snippets=("MultiprocessingSerializer.deserialize(recv_req.serialized_named_tensors[self.tp_rank])",)),
    SourceCheck("srt/managers/io_struct.py", "UpdateWeightsFromTensorReqInput", "tensor hand-off request",
                names=("serialized_named_tensors", "load_format", "flush_cache", "weight_version")),
    SourceCheck("srt/managers/io_struct.py", "InitWeightsUpdateGroupReqInput", "weight group set-up",
                names=("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")),
    SourceCheck("srt/managers/io_struct.py", "PauseGenerationReqInput", "pause modes", names=("mode",)),
    SourceCheck("srt/utils/common.py", "MultiprocessingSerializer.serialize", "TensorWeightSync payload",
                snippets=("def serialize(obj, output_str: bool = False):",)),
    SourceCheck("srt/utils/common.py", "init_custom_process_group",
                "weight group rendezvous whose store keys slime_sparse.utils.weight_sync.new_group mirrors",
                snippets=("rendezvous(init_method, rank, world_size, timeout=timeout)",
                          "store = PrefixStore(group_name, store)",
                          "_new_process_group_helper(")),
    SourceCheck("srt/entrypoints/http_server.py", "", "HTTP routes the engine calls",
                snippets=('"/generate"', '"/flush_cache"', '"/update_weights_from_distributed"',
                          '"/update_weights_from_tensor"', '"/init_weights_update_group"', '"/pause_generation"',
                          '"/continue_generation"', '"/health"', '"/release_memory_occupation"',
                          '"/resume_memory_occupation"')),
)

# Hook targets whose definition the checks above locate (every HookSpec must be covered).
HOOKED_SYMBOLS = {spec.target for spec in HOOKS}


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _find(tree: ast.Module, dotted: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in dotted.split("."):
        body = getattr(node, "body", [])
        found = None
        for child in body:
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == part:
                found = child
        if found is None:
            return None
        node = found
    return node


def defined_names(node: ast.AST) -> set[str]:
    """Names a class (or module) defines: defs, assigned/annotated names in its body, and `self.x = ...`."""
    names: set[str] = set()
    for child in getattr(node, "body", []):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)
        elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
            names.add(child.target.id)
        elif isinstance(child, ast.Assign):
            names.update(t.id for t in child.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        else:
            targets = []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def run_check(check: SourceCheck, package_dir: Path) -> list[str]:
    """Problems found for one check (empty = it holds)."""
    file = package_dir / check.path
    if not file.is_file():
        return [f"{check.dotted}: file {check.path} is missing ({check.why})"]
    source = file.read_text(encoding="utf-8")
    tree = ast.parse(source)
    node = _find(tree, check.symbol) if check.symbol else tree
    if node is None:
        return [f"{check.dotted}: symbol not found ({check.why})"]
    problems = []
    if check.names:
        missing = sorted(set(check.names) - defined_names(node))
        if missing:
            problems.append(f"{check.dotted}: does not define {missing} ({check.why})")
    segment = _squash((ast.get_source_segment(source, node) or "") if check.symbol else source)
    for snippet in check.snippets:
        if _squash(snippet) not in segment:
            problems.append(f"{check.dotted}: expected code `{snippet}` not found ({check.why})")
    return problems


def hooked_symbols_located(package_dir: Path) -> list[str]:
    """Every hook target resolves to a def/class in the source (what HookRegistry will resolve at start-up)."""
    problems = []
    for target in sorted(HOOKED_SYMBOLS):
        parts = target.split(".")
        for split in range(len(parts) - 1, 0, -1):  # longest module path that is a file
            file = package_dir / Path(*parts[1:split]).with_suffix(".py")
            if file.is_file():
                node = _find(ast.parse(file.read_text(encoding="utf-8")), ".".join(parts[split:]))
                if node is None:
                    problems.append(f"hook target {target}: not defined in {file.relative_to(package_dir)}")
                break
        else:
            problems.append(f"hook target {target}: no module file found")
    return problems


def check_contract(package_dir: Path) -> list[str]:
    """All problems of the pinned-SGLang contract for the `sglang` package directory given."""
    problems = hooked_symbols_located(package_dir)
    for check in CHECKS:
        problems.extend(run_check(check, package_dir))
    return problems


def installed_package_dir() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed here; pass --source DIR (an unpacked wheel)")
    return Path(list(spec.submodule_search_locations)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Check SGLang's source against our hooks (pinned {SGLANG_VERSION})")
    parser.add_argument("--source", type=Path, default=None, help="directory that contains the sglang/ package")
    args = parser.parse_args(argv)
    package_dir = args.source / "sglang" if args.source else installed_package_dir()
    problems = check_contract(package_dir)
    for line in problems:
        print("FAIL", line)
    print(f"{len(CHECKS)} checks + {len(HOOKED_SYMBOLS)} hook targets against {package_dir}: "
          f"{'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
