"""EmbeddedEngine: batched, budgeted-KV sampling over a transformers causal LM, in this process.

Three parts, as in nano-vllm: this public engine (weights, KV configs, the runner's lifetime, KV-memory admission,
the step loop: schedule, run, postprocess), the scheduler (scheduler.py: the host side of a call, continuous
batching, when rows compress; it returns work orders, orders.py), the runner (runner.py: the device side, built once
and reused: the cache, the decode step captured as CUDA graphs, the compressor); every row's state has one owner
(rows.py). Decode steps (step.py) never wait for the device; compactions (compressor.py) run between steps.

KV bound. Compression on: a row holds at most (the largest layer budget) + buffer slots at any time, during prefill
too (prompts longer than that are prefilled in chunks with compressions in between). Compression off (or a budget
above the longest possible sequence): the cache holds the whole sequence, exactly like dense decoding.
Memory: given `kv_cache_gib` (or `mem_fraction` of the free memory), as many sequences at once as fit with every
working set (kv/engine_memory.py), so compression becomes concurrency. A `memory_saver` engine gives that memory back
between rollouts and keeps its CUDA graphs (`release_memory` / `resume_memory`, --offload-rollout; arena.py).

Random streams: sample i of a call seeded `seed` draws its t-th token with the Gumbel noise of
counter_stream(derive_seed(seed, i), t) (`sampling.sample_tokens`): its tokens depend on neither the batch it runs
in, nor the step mode, nor how a call is split across engines.
"""
from __future__ import annotations

import os
from collections import deque
from typing import Callable, Mapping

import torch
from torch import Tensor, nn

from slime_sparse.kv import KVCompressConfig, engine_memory, layer_budgets, row_capacity
from slime_sparse.rollout.base import KVView, WeightSource
from slime_sparse.rollout.partial import GroupStop, PartialSpec
from slime_sparse.rollout.sampling import SamplingParams, derive_seed, enable_kernel
from slime_sparse.types import GenerationOutput
from slime_sparse.utils.device import check_memory_size, free_memory_bytes
from slime_sparse.utils.hf import load_model
from slime_sparse.utils.lm_head import hf_head_weight, lm_head_logits
from slime_sparse.utils.model_shape import ModelShape

from .attention import budget_attention_installed, pick_decode_attention
from .contract import check_model, eos_ids
from .decode_body import DecodeBody, build as build_body
from .prompts import LONG_PROMPT_POLICIES, check_prompts
from .runner import ModelRunner, RunnerShape
from .rows import Rows, check_rows_default
from .scheduler import Scheduler, SchedulerConfig
from .sequence import KVTraceRecord, Sequence
from .step import STEP_MODES
from .stats import GenerateStats
from .weights import copy_weights

DEFAULT_MAX_BATCH_SIZE = 64  # sequences at once when no memory size is given
__all__ = ["EmbeddedEngine", "GenerateStats"]


class EmbeddedEngine:
    """Rollout engine over a Qwen2/Qwen2.5/Llama-style transformers model (any model whose attention goes
    through transformers' AttentionInterface and `past_key_values.update`, with full attention in every layer).

    model_or_path: a PreTrainedModel, or a local HF directory (loaded with AutoModelForCausalLM).
    kv: the compression config (method "none" = dense cache).
    dtype: None keeps the model's dtype (float32 when loading from a path).
    max_prompt_len: prompts longer than this are rejected / skipped (None: only the model context bounds them).
    on_long_prompt: "error" raises ValueError, "skip" returns finish_reason "skipped" with no tokens and
      counts them in `num_skipped_prompts`.
    kv_trace: optional callback receiving a KVTraceRecord per sequence per forward (tests, debugging; it makes
      decoding step by step and eager).
    step_mode: how decode steps run: "cuda_graph" (one CUDA graph per padded batch size and span, captured on first
      use; the default on CUDA), "cuda_graph_compile" (those graphs capture the step compiled by inductor),
      "compile" (torch.compile(fullgraph=True)) or "eager" (the default on CPU, where compiling does not pay:
      benchmarks/README.md). Every mode computes the same step.
    readback_interval: decode steps between two reads of the sampled tokens. Each read is a copy that does not
      wait: the host learns a sequence ended up to two windows late, and its row computes throwaway tokens until
      then. Default: 8 on CUDA, 1 on CPU (nothing to overlap with there: every step is read at once, and no row
      ever runs past its end).
    fp32_lm_head: the LM head in fp32 (--enable-fp32-lm-head; `slime_sparse.utils.lm_head`).
    kv_cache_gib: memory for the cache and every working set (--rollout-kv-cache-gib): the engine decodes as many
      sequences at once as fit in it (`memory_spec`; at most max_batch_size, if given). mem_fraction: instead, that
      fraction of the device's free memory once the weights are loaded (--rollout-mem-fraction).
    max_batch_size: None: no cap with a memory size (what fits), else DEFAULT_MAX_BATCH_SIZE.
    memory_saver: `release_memory` gives the cache back but keeps the runner and its graphs (--offload-rollout).
    decode_attention: "triton" (a split-KV kernel reading each row's length; the default on CUDA if it passes its
      self-check against SDPA) or "sdpa" (a mask over the padded span; the default elsewhere).
    hf_decode: decode through HF's modules (as prefill does), not our decode body (decode_body.py; Qwen2 / Llama:
      other models always use HF's modules, `decode_body_reason` says why).
    check_rows: after every decode window, assert the host's row table and the device agree (rows.py; a host sync, for
      debugging and tests). None: the SLIME_SPARSE_CHECK_ROWS environment variable.
    """

    def __init__(
        self,
        model_or_path: nn.Module | str | os.PathLike,
        kv: KVCompressConfig | None = None,
        *,
        max_batch_size: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_prompt_len: int | None = None,
        on_long_prompt: str = "error",
        kv_trace: Callable[[KVTraceRecord], None] | None = None,
        step_mode: str | None = None,
        readback_interval: int | None = None,
        fp32_lm_head: bool = False,
        kv_cache_gib: float | None = None,
        mem_fraction: float | None = None,
        memory_saver: bool = False,
        decode_attention: str | None = None,
        hf_decode: bool = False,
        check_rows: bool | None = None,
    ) -> None:
        self.kv = kv if kv is not None else KVCompressConfig()
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 (--rollout-max-batch-size)")
        check_memory_size(kv_cache_gib, mem_fraction)
        if max_prompt_len is not None and max_prompt_len < 1:
            raise ValueError(f"max_prompt_len={max_prompt_len} must be >= 1 or None (--rollout-max-prompt-len)")
        if on_long_prompt not in LONG_PROMPT_POLICIES:
            raise ValueError(f"on_long_prompt={on_long_prompt!r} is invalid: choose one of {LONG_PROMPT_POLICIES}")
        self.device = torch.device(device)
        step_mode = step_mode or ("cuda_graph" if self.device.type == "cuda" else "eager")
        if step_mode not in STEP_MODES or (step_mode.startswith("cuda_graph") and self.device.type != "cuda"):
            raise ValueError(f"step_mode={step_mode!r} is invalid on {self.device.type}: choose one of {STEP_MODES} "
                             "(cuda_graph needs a CUDA device; --rollout-disable-cuda-graph runs eagerly)")
        if readback_interval is None:
            readback_interval = 8 if self.device.type == "cuda" else 1
        if readback_interval < 1:
            raise ValueError(f"readback_interval={readback_interval} must be >= 1")
        self.step_mode = step_mode
        self.readback_interval = readback_interval
        self.model = load_model(model_or_path, self.device, dtype)
        check_model(self.model)
        self.model_shape = ModelShape.from_hf_config(self.model.config.to_dict())
        self.head_weight = hf_head_weight(self.model)  # the tensor itself: update_weights copies into it in place
        self.decode_attention = pick_decode_attention(decode_attention, self.device)
        self._decode_body, self.decode_body_reason = (None, "hf_decode=True") if hf_decode else build_body(self.model)
        self.fused_sampler = enable_kernel(self.device)  # CUDA: the one-kernel sampler, if it checks out
        self.fp32_lm_head = fp32_lm_head
        if mem_fraction is not None:  # read once, now: the weights are loaded, the rows are sized from what is left
            kv_cache_gib = mem_fraction * free_memory_bytes(self.device) / 2**30
        self.kv_cache_gib = kv_cache_gib
        self.max_batch_size = max_batch_size if max_batch_size is not None or kv_cache_gib is not None \
            else DEFAULT_MAX_BATCH_SIZE
        self.memory_saver = memory_saver
        self.runner_builds = 0  # runners built so far (each allocates a cache; with graphs, captures them anew)
        self.max_prompt_len, self.on_long_prompt = max_prompt_len, on_long_prompt
        self.kv_trace = kv_trace
        self.check_rows = check_rows_default() if check_rows is None else check_rows
        self.num_skipped_prompts = 0  # cumulative over calls (on_long_prompt="skip")
        self.last_stats = GenerateStats()  # what the last generate() call did
        self._weight_version = 0
        self._runner: ModelRunner | None = None  # lives across calls: its cache, state and CUDA graphs

    @property
    def last_kv_cache_bytes(self) -> int:
        """Keys + values allocated by the last generate() call: its peak KV memory."""
        return self.last_stats.kv_cache_bytes

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, kv: KVCompressConfig | None = None, **kwargs) -> "EmbeddedEngine":
        return cls(path, kv, **kwargs)

    # ---- RolloutEngine protocol ----
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def update_weights(self, state_dict: Mapping[str, Tensor], version: int | None = None) -> None:
        """Copy new weights into the model's tensors in place (no rebuild) and bump weight_version. Every parameter /
        buffer must be provided, except aliases of a provided tensor (a tied LM head); each is cast to the model's dtype
        and device (weights.py)."""
        copy_weights(self.model, state_dict)
        self._weight_version = self._weight_version + 1 if version is None else int(version)

    def sync_from(self, learner: WeightSource) -> None:
        """Load the learner's current weights (in this process: its tensors, copied in place)."""
        self.update_weights(dict(learner.named_weights()))

    def with_kv(self, kv: KVCompressConfig) -> KVView:
        """This engine under another KV config (dense evaluation): the same model, weights and version."""
        return KVView(self, kv)

    def release_memory(self) -> None:
        """Give back the KV cache (the learner trains in it); a memory_saver engine keeps its runner and graphs."""
        if self._runner is not None and self.memory_saver and self._runner.can_release:
            self._runner.release()
        else:
            self._runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Take the KV cache back (generate() also does it when it must)."""
        if self._runner is not None:
            self._runner.resume()

    @property
    def captures(self) -> int:
        """CUDA graphs the current runner holds (decode steps and compactions)."""
        return self._runner.captures if self._runner is not None else 0

    # ---- generation ----
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None, index_offset: int = 0, *,
        kv: KVCompressConfig | None = None, partial: PartialSpec | None = None,
    ) -> list[GenerationOutput]:
        """`index_offset`: where these prompts sit in a larger call split across engines, so that sample
        i always draws from the random stream of (seed, index_offset + i) whichever engine runs it.
        `kv`: generate under this KV config instead of the engine's own (a validated one: see `with_kv`).
        `partial` (--partial-rollout): stop once enough groups finished, the rest handed out with finish_reason
        "abort"; and continue earlier aborted outputs (their own streams and eviction records) where it says so."""
        params.validate()
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        accepted = check_prompts(prompts, outputs, vocab=self.model.config.vocab_size,
                                 context=self.model.config.max_position_embeddings, max_prompt_len=self.max_prompt_len,
                                 on_long_prompt=self.on_long_prompt, weight_version=self._weight_version)
        self.num_skipped_prompts += sum(out is not None for out in outputs)
        partial = partial.check(prompts) if partial is not None else None
        stop = partial.stop(accepted) if partial is not None else None
        if accepted:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,)).item())  # follows torch.manual_seed
            resume = partial.resume if partial is not None else [None] * len(prompts)
            sequences = [Sequence.continuing(i, resume[i]) if resume[i] is not None else
                         Sequence(index=i, prompt=[int(t) for t in prompts[i]], key=derive_seed(seed, index_offset + i))
                         for i in accepted]
            with torch.inference_mode(), budget_attention_installed(self.model):
                self._generate(sequences, params, self.kv if kv is None else kv, outputs, stop)
        return outputs  # type: ignore[return-value]

    def _generate(self, sequences: list[Sequence], params: SamplingParams, kv: KVCompressConfig,
                  outputs: list[GenerationOutput | None], stop: GroupStop | None = None) -> None:
        context, n_layers = self.model.config.max_position_embeddings, self.model.config.num_hidden_layers
        longest = min(max(len(s.prompt) for s in sequences) + params.max_new_tokens, context)
        budgets = layer_budgets(kv, n_layers) if kv.enabled else (kv.budget,) * n_layers
        prefill = max(len(s.prefill_tokens) for s in sequences)  # a continuation prefills its response so far too
        shape = self._runner_shape(kv, longest, len(sequences), prefill, params)
        if self._decode_body is not None and not self._decode_body.restore():  # a dtype / device conversion:
            self._decode_body, self._runner = DecodeBody(self.model), None  # fuse anew, and a cache of that dtype
        if self._runner is None or not self._runner.shape.holds(shape):
            self._runner = None  # free the old cache before allocating the new one
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._runner = ModelRunner(self.model, shape, budgets, self.device, self._logits, self._decode_body,
                                       self.decode_attention, releasable=self.memory_saver)
            self.runner_builds += 1
        runner = self._runner
        runner.resume()  # a no-op unless the memory was given back
        stats = self.last_stats = GenerateStats(kv_cache_bytes=runner.cache.kv_bytes, rows=runner.cache.num_rows,
                                                slots=runner.cache.capacity)
        captures = runner.captures
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids(self.model))
        config = SchedulerConfig(kv, params, budgets, row_capacity(kv, longest), context, stop_ids,
                                 self._weight_version, shape.rows)
        scheduler = Scheduler(config, Rows(runner.cache, runner.state, params.max_new_tokens, self.check_rows),
                              runner.step_shape, deque(sequences), outputs, stats, self.kv_trace, stop)
        while (order := scheduler.schedule()) is not None:  # nano-vllm's LLMEngine.step: schedule, run, postprocess
            scheduler.postprocess(order, runner.run(order))
        stats.captures = runner.captures - captures

    def _runner_shape(self, kv: KVCompressConfig, longest: int, sequences: int, prompt: int | None = None,
                      params: SamplingParams | None = None) -> RunnerShape:
        """What a call of `sequences` sequences of at most `longest` tokens (prompts of at most `prompt`) needs: the
        runner of the last call serves it if it holds that much. With graphs, capacity is rounded up to the span
        granularity (graphs read spans of that granularity anyway), so that calls of similar lengths share one
        runner."""
        mode = "eager" if self.kv_trace is not None else self.step_mode  # tracing reads the cache after every forward
        capacity = engine_memory.runner_capacity(kv, longest, mode != "eager", self.model.config.max_position_embeddings)
        spec = self.memory_spec(kv, capacity, prompt, params, mode)
        return RunnerShape(kv, min(self.max_rows(spec), sequences), capacity, mode, self.readback_interval)

    def rows_for(self, kv: KVCompressConfig, longest: int, prompt: int | None = None,
                 params: SamplingParams | None = None) -> int:
        """Sequences of at most `longest` tokens this engine decodes at once under `kv`: --rollout-max-batch-size, or
        what fits in --rollout-kv-cache-gib (the smaller of the two)."""
        return self._runner_shape(kv, longest, 2**62, prompt, params).rows

    def memory_spec(self, kv: KVCompressConfig, capacity: int, prompt: int | None = None,
                    params: SamplingParams | None = None, mode: str | None = None) -> engine_memory.EngineSpec:
        """What this engine's memory depends on for rows of `capacity` slots (kv/engine_memory.py): prompts of at most
        `prompt` tokens (None: a full row), sampled with `params` (None: the defaults)."""
        return engine_memory.EngineSpec(
            self.model_shape, kv, capacity, min(prompt or capacity, capacity), self.model.dtype.itemsize,
            engine_memory.Sampler.of(params or SamplingParams(), self.fused_sampler), self.fp32_lm_head,
            graphs=(mode or self.step_mode).startswith("cuda_graph"), readback=self.readback_interval,
            device=self.device.type, decode_body=self._decode_body is not None, decode_attention=self.decode_attention)

    def max_rows(self, spec: engine_memory.EngineSpec) -> int:
        """Rows this engine allocates at most: max_batch_size, or what fits in kv_cache_gib with every working set
        (`engine_memory.engine_bytes`), the smaller of the two."""
        if self.kv_cache_gib is None:
            return self.max_batch_size
        fit = engine_memory.max_rows(spec, int(self.kv_cache_gib * 2**30), self.max_batch_size)
        if fit < 1:
            raise ValueError(f"kv_cache_gib={self.kv_cache_gib} holds no row of {spec.capacity} slots and its working "
                             f"sets under --kv-method {spec.kv.method} (--rollout-kv-cache-gib)")
        return fit

    def _logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits [n, V] float32 from the final hidden states [n, hidden]: the learners' head arithmetic
        (`utils.lm_head`, fp32 with --enable-fp32-lm-head); no host sync, so it runs inside the captured step."""
        return lm_head_logits(hidden, self.head_weight, fp32=self.fp32_lm_head)
