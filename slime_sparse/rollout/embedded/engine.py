"""EmbeddedEngine: batched, budgeted-KV sampling over a transformers causal LM, in this process.

How a generate() call runs (nano-vllm's scheduler shape, without pages):
- one BudgetKVCache with max_batch_size rows is allocated for the call; running sequences always occupy
  rows [0, n_running), so every decode step reads plain views of the cache;
- continuous batching: whenever a sequence finishes, the last running row moves into its place and the
  next waiting prompt is admitted at the end, then prefilled (eagerly; chunked when the cache bound demands it);
- decoding runs in windows of `readback_interval` steps. A step (step.py) has fixed shapes and never waits for
  the device: rows padded to a few batch sizes, every per-row quantity (token, position, fill, random stream
  counter) in device tensors updated in place, so it can be replayed from a CUDA graph. The host follows every
  row's fill in numpy mirrors (admission, steps and compressions are its own decisions), so it knows when a row
  reaches its trigger without reading the device; it learns which sequences sampled a stop token when a window's
  tokens arrive (a copy that does not wait; on CUDA the previous window is handed out while this one runs);
- between steps, every row that reached its trigger is compressed in one batched call per layer (scores,
  top-k, gather: slime_sparse.kv); rows that reached it together compress together.

KV bound. Compression on: a row holds at most (the largest layer budget) + buffer slots at any time, during prefill
too (prompts longer than that are prefilled in chunks with compressions in between). Compression off (or a budget
above the longest possible sequence): the cache holds the whole sequence, exactly like dense decoding.

Random streams: sample i of a call seeded `seed` draws its t-th token from counter_uniform(derive_seed(seed, i), t),
so its tokens do not depend on the batch it runs in, on the step mode, or on how a call is split across engines.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from slime_sparse.kv import KVCompressConfig, compress_indices, layer_budgets, row_capacity, should_compress, trigger
from slime_sparse.rollout.base import KVView, WeightSource
from slime_sparse.rollout.sampling import SamplingParams, derive_seed, sample_tokens
from slime_sparse.types import GenerationOutput, KVStats
from slime_sparse.utils.faults import fault_point
from slime_sparse.utils.hf import load_model
from slime_sparse.utils.lm_head import hf_head_weight, lm_head_logits

from .attention import CACHE_KWARG, budget_attention_installed
from .cache import BudgetKVCache
from .plan import build_plan
from .sequence import KVTraceRecord, Sequence
from .step import NO_MASK, STEP_MODES, DecodeState, DecodeStep, bucket_for, decode_shapes

LONG_PROMPT_POLICIES = ("error", "skip")
SCORE_SCRATCH_BYTES = {False: 4 << 20, True: 1 << 30}  # per batched scoring call: CPU (about an L2 cache), CUDA


@dataclass
class GenerateStats:
    """What one generate() call did (`EmbeddedEngine.last_stats`)."""

    forwards: int = 0  # model forwards: prefill chunks and decode steps
    prefill_tokens: int = 0  # prompt tokens run through the model
    prefill_tokens_saved: int = 0  # prompt tokens not run: the n samples of a prompt share one prefill
    compressions: int = 0  # cache-row compressions (a shared prefill's compression counts once)
    kv_cache_bytes: int = 0  # keys + values allocated for the call (the cache never grows: its peak)


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
      use; the default on CUDA), "compile" (torch.compile(fullgraph=True)) or "eager" (the default on CPU, where
      compiling does not pay: benchmarks/README.md). Every mode computes the same step.
    readback_interval: decode steps between two reads of the sampled tokens. Each read is a copy that does not
      wait: the host learns a sequence ended up to two windows late, and its row computes throwaway tokens until
      then. Default: 8 on CUDA, 1 on CPU (nothing to overlap with there: every step is read at once, and no row
      ever runs past its end).
    fp32_lm_head: the LM head in fp32 (--enable-fp32-lm-head; `slime_sparse.utils.lm_head`).
    """

    def __init__(
        self,
        model_or_path: nn.Module | str | os.PathLike,
        kv: KVCompressConfig | None = None,
        *,
        max_batch_size: int = 64,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_prompt_len: int | None = None,
        on_long_prompt: str = "error",
        kv_trace: Callable[[KVTraceRecord], None] | None = None,
        step_mode: str | None = None,
        readback_interval: int | None = None,
        fp32_lm_head: bool = False,
    ) -> None:
        self.kv = kv if kv is not None else KVCompressConfig()
        self.kv.validate()
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 (--rollout-max-batch-size)")
        if max_prompt_len is not None and max_prompt_len < 1:
            raise ValueError(f"max_prompt_len={max_prompt_len} must be >= 1 or None (--rollout-max-prompt-len)")
        if on_long_prompt not in LONG_PROMPT_POLICIES:
            raise ValueError(f"on_long_prompt={on_long_prompt!r} is invalid: choose one of {LONG_PROMPT_POLICIES}")
        self.device = torch.device(device)
        step_mode = step_mode or ("cuda_graph" if self.device.type == "cuda" else "eager")
        if step_mode not in STEP_MODES or (step_mode == "cuda_graph" and self.device.type != "cuda"):
            raise ValueError(f"step_mode={step_mode!r} is invalid on {self.device.type}: choose one of {STEP_MODES} "
                             "(cuda_graph needs a CUDA device; --rollout-disable-cuda-graph runs eagerly)")
        if readback_interval is None:
            readback_interval = 8 if self.device.type == "cuda" else 1
        if readback_interval < 1:
            raise ValueError(f"readback_interval={readback_interval} must be >= 1")
        self.step_mode = step_mode
        self.readback_interval = readback_interval
        self.model = load_model(model_or_path, self.device, dtype)
        _check_model(self.model)
        self.head_weight = hf_head_weight(self.model)  # the tensor itself: update_weights copies into it in place
        self.fp32_lm_head = fp32_lm_head
        self.max_batch_size = max_batch_size
        self.max_prompt_len = max_prompt_len
        self.on_long_prompt = on_long_prompt
        self.kv_trace = kv_trace
        self.num_skipped_prompts = 0  # cumulative over calls (on_long_prompt="skip")
        self.last_stats = GenerateStats()  # what the last generate() call did
        self._weight_version = 0

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
        """Copy new weights into the model's tensors in place (no rebuild) and bump weight_version.

        Every parameter/buffer of the model must be provided, except aliases of a provided tensor (a tied
        LM head). Tensors are cast to the model's dtype and device.
        """
        own = self.model.state_dict()
        unexpected = sorted(k for k in state_dict if k not in own)
        if unexpected:
            raise ValueError(f"update_weights: unknown weight names {unexpected[:5]} (model has {len(own)} tensors)")
        provided_storage = {own[k].data_ptr() for k in state_dict}
        missing = sorted(k for k, t in own.items() if k not in state_dict and t.data_ptr() not in provided_storage)
        if missing:
            raise ValueError(f"update_weights: missing weights {missing[:5]} ({len(missing)} in all)")
        for name, src in state_dict.items():
            if tuple(src.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(src.shape)}, the model's is {tuple(own[name].shape)}"
                )
        with torch.no_grad():
            for name, src in state_dict.items():
                own[name].copy_(src)  # state_dict() tensors share storage with the model's parameters
        self._weight_version = self._weight_version + 1 if version is None else int(version)

    def sync_from(self, learner: WeightSource) -> None:
        """Load the learner's current weights (in this process: its tensors, copied in place)."""
        self.update_weights(dict(learner.named_weights()))

    def with_kv(self, kv: KVCompressConfig) -> KVView:
        """This engine under another KV config (dense evaluation): the same model, weights and version."""
        kv.validate()
        return KVView(self, kv)

    def release_memory(self) -> None:
        """The KV cache only lives inside generate(); all that is left to give back is allocator cache."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Nothing to do: generate() allocates its cache itself."""

    # ---- generation ----
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None, index_offset: int = 0, *,
        kv: KVCompressConfig | None = None,
    ) -> list[GenerationOutput]:
        """`index_offset`: where these prompts sit in a larger call split across engines, so that sample
        i always draws from the random stream of (seed, index_offset + i) whichever engine runs it.
        `kv`: generate under this KV config instead of the engine's own (a validated one: see `with_kv`)."""
        params.validate()
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        accepted = self._check_prompts(prompts, outputs)
        if accepted:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,)).item())  # follows torch.manual_seed
            sequences = [Sequence(index=i, prompt=[int(t) for t in prompts[i]], key=derive_seed(seed, index_offset + i))
                         for i in accepted]
            with torch.inference_mode(), budget_attention_installed(self.model):
                _Run(self, sequences, params, self.kv if kv is None else kv).run(outputs)
        return outputs  # type: ignore[return-value]

    def _check_prompts(self, prompts: list[list[int]], outputs: list[GenerationOutput | None]) -> list[int]:
        """Indices of the prompts to generate for; skipped ones get their output here."""
        vocab = self.model.config.vocab_size
        context = self.model.config.max_position_embeddings
        accepted, too_long = [], []
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                bad = [int(t) for t in prompt if not 0 <= t < vocab]
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
            limit = min(context - 1, self.max_prompt_len or context)  # leave room for one response token
            if len(prompt) > limit:
                too_long.append(i)
                if self.on_long_prompt == "error":
                    raise ValueError(
                        f"prompt {i} has {len(prompt)} tokens, over the limit of {limit} "
                        f"(max_prompt_len={self.max_prompt_len}, model context max_position_embeddings={context} "
                        f"minus one response token); construct the engine with on_long_prompt='skip' to skip it"
                    )
                outputs[i] = GenerationOutput(
                    prompt_ids=list(prompt), response_ids=[], logprobs=[], finish_reason="skipped",
                    kv=KVStats(), weight_version=self._weight_version,
                )
            else:
                accepted.append(i)
        self.num_skipped_prompts += len(too_long)
        return accepted


class _Run:
    """One generate() call: the cache, the queue and the decoding loop."""

    def __init__(self, engine: EmbeddedEngine, sequences: list[Sequence], params: SamplingParams,
                 kv: KVCompressConfig) -> None:
        self.engine = engine
        self.model = engine.model
        self.kv = kv
        self.params = params
        self.device = engine.device
        self.waiting = deque(sequences)
        self.running: list[Sequence] = []  # running[r] lives in cache row r
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else _eos_ids(self.model))
        self.context = self.model.config.max_position_embeddings
        longest = min(max(len(s.prompt) for s in sequences) + params.max_new_tokens, self.context)
        n_layers = self.model.config.num_hidden_layers
        self.budgets = layer_budgets(kv, n_layers) if kv.enabled else (kv.budget,) * n_layers
        self.trigger = trigger(kv)  # the fullest layer's slots at which a row compresses (kv/schedule.py)
        self.capacity = row_capacity(self.kv, longest)  # every layer holds that many before the first compression
        rows = min(engine.max_batch_size, len(sequences))
        self.cache = self._allocate(rows)
        self.stats = engine.last_stats = GenerateStats(kv_cache_bytes=self.cache.kv_bytes)
        # Tracing reads the cache after every forward, so it decodes step by step.
        tracing = engine.kv_trace is not None
        self.readback = 1 if tracing else engine.readback_interval
        mode = "eager" if tracing else engine.step_mode
        self.buckets, self.span_granularity = decode_shapes(mode, rows)
        self.state = DecodeState.allocate(rows, self.readback, self.device)
        self.step = DecodeStep(self.model, self.cache, self.state, params, self._logits, mode)
        # host mirrors of the rows (never read back from the device): response tokens sampled so far, how many
        # the row may sample, and the cache fill each sampled token's logits came from
        self.issued = np.zeros(rows, dtype=np.int64)
        self.limit = np.zeros(rows, dtype=np.int64)
        # per sampled token, the slots its logits' context held: summed over layers (KV memory) and in the fullest one
        self.kept_log = np.zeros((rows, params.max_new_tokens), dtype=np.int64)
        self.peak_log = np.zeros((rows, params.max_new_tokens), dtype=np.int64)
        self.pending: deque[_Readback] = deque()

    def _allocate(self, rows: int) -> BudgetKVCache:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return BudgetKVCache(
            num_rows=rows,
            num_kv_heads=cfg.num_key_value_heads,
            num_q_heads=cfg.num_attention_heads,
            head_dim=head_dim,
            capacities=[self.capacity] * cfg.num_hidden_layers,
            window=self.kv.window,
            record_queries=self.kv.enabled,
            track_mass=self.kv.traits.tracks_mass,
            device=self.device,
            dtype=self.model.dtype,
            shared_fill=len(set(self.budgets)) == 1,
        )

    def _logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits [n, V] float32 from the final hidden states [n, hidden]: the learners' head arithmetic
        (`utils.lm_head`, fp32 with --enable-fp32-lm-head); no host sync, so it runs inside the captured step."""
        return lm_head_logits(hidden, self.engine.head_weight, fp32=self.engine.fp32_lm_head)

    def run(self, outputs: list[GenerationOutput | None]) -> None:
        rows = self.cache.num_rows
        for row in range(rows):
            self.cache.park_row(row)
        while self.waiting or self.running:
            admitted: list[Sequence] = []
            while self.waiting and len(self.running) + len(admitted) < rows:
                admitted.append(self.waiting.popleft())
            if admitted:
                self._admit(admitted)
                self._retire(outputs)
            if self.running:
                self._decode_window()
                self._retire(outputs)

    # ---- prefill ----
    def _admit(self, admitted: list[Sequence]) -> None:
        """Prefill the admitted prompts, each distinct prompt once (GRPO's n samples of a prompt share it), and
        sample their first tokens.

        The first sample of each prompt (its leader) is prefilled in a row of its own; the others (followers) get a
        copy of that row once the prompt is done, before any decode-time compression, so they continue from the very
        cache they would have built themselves. Leaders fill rows [first, first + n_leaders), followers the rows after.
        Prefill runs eagerly (its shapes vary); it reads the first tokens back at once.
        """
        groups: dict[tuple[int, ...], list[Sequence]] = {}
        for seq in admitted:
            groups.setdefault(tuple(seq.prompt), []).append(seq)
        leaders = [group[0] for group in groups.values()]
        followers = {id(group[0]): group[1:] for group in groups.values()}
        first = len(self.running)
        self.running += leaders + [f for group in groups.values() for f in group[1:]]
        for row in range(first, len(self.running)):
            self.cache.reset_row(row)
            self.issued[row] = 0
        prefill = sum(len(s.prompt) for s in leaders)
        self.stats.prefill_tokens += prefill
        self.stats.prefill_tokens_saved += sum(len(s.prompt) for s in admitted) - prefill
        follower_rows, row = {}, first + len(leaders)
        for leader in leaders:
            follower_rows[id(leader)] = range(row, row + len(followers[id(leader)]))
            row += len(followers[id(leader)])
        fill = self.cache.fill_host
        while any(s.processed < len(s.prompt) for s in leaders):
            rows = range(first, first + len(leaders))
            room = [self.capacity - int(fill[:, r].max()) for r in rows]
            chunks = [s.pending_prompt(room_r) for s, room_r in zip(leaders, room)]
            logits = self._prefill(first, chunks, [s.processed for s in leaders])
            for b, (seq, row, chunk) in enumerate(zip(leaders, rows, chunks)):
                if not chunk:
                    continue  # prompt already done: this row only rode along
                seq.processed += len(chunk)
                seq.prefill_peak = max(seq.prefill_peak, int(fill[:, row].max()))
                self._trace(row, [seq, *followers[id(seq)]], range(seq.processed - len(chunk), seq.processed))
                if seq.processed < len(seq.prompt):
                    if should_compress(int(fill[:, row].max()), self.kv):  # a long prompt, prefilled in chunks
                        self._compress_rows([row], [[seq]])
                    continue
                group = [seq] + followers[id(seq)]
                for f in followers[id(seq)]:
                    f.processed, f.prefill_peak, f.evictions = seq.processed, seq.prefill_peak, list(seq.evictions)
                self._sample_first(group, [row, *follower_rows[id(seq)]], logits[b])
                live = [s for s in group if not s.finished]
                if live and should_compress(int(fill[:, row].max()), self.kv, first_decode=True):
                    self._compress_rows([row], [live])
                for f, f_row in zip(followers[id(seq)], follower_rows[id(seq)]):
                    if not f.finished:
                        self.cache.copy_row(row, f_row)

    def _prefill(self, row_start: int, chunks: list[list[int]], first_positions: list[int]) -> Tensor:
        """Run each row's chunk through the model (rows [row_start, row_start + len(chunks))); next-token logits
        [n, V] of every row's last column."""
        fault_point("engine.step")  # chaos tests: a kill mid-rollout (prefill or decode)
        cache = self.cache
        rows = slice(row_start, row_start + len(chunks))
        plan = build_plan(row_start, chunks, cache.fill_host[:, rows].tolist(), first_positions, self.kv.window,
                          self.device)
        cache.begin_prefill(plan)
        hidden = self.step.body(
            input_ids=plan.input_ids, position_ids=plan.position_ids, attention_mask=NO_MASK, use_cache=True,
            **{self.step.cache_kwarg: cache, CACHE_KWARG: cache},
        ).last_hidden_state[:, -1]
        cache.end_prefill(plan, [len(c) for c in chunks])
        self.stats.forwards += 1
        return self._logits(hidden)

    def _sample_first(self, group: list[Sequence], rows: list[int], logits: Tensor) -> None:
        """Sample the first response token of every sequence of a prompt group from the prompt's logits [V], and
        set up their rows for decoding."""
        n = len(group)
        keys = torch.tensor([s.key for s in group], dtype=torch.int64, device=self.device)
        tokens, logprobs = sample_tokens(logits.expand(n, -1), self.params, keys, torch.zeros_like(keys))
        fill = self.cache.fill_host[:, rows[0]]  # the first token's logits saw the whole prefilled prompt
        for seq, row, token, logprob in zip(group, rows, tokens.tolist(), logprobs.tolist()):
            self._append(seq, token, logprob)
            self.issued[row] = 1
            self.limit[row] = min(self.params.max_new_tokens, self.context - len(seq.prompt))
            self.kept_log[row, 0], self.peak_log[row, 0] = fill.sum(), fill.max()
            self.state.set_row(row, token, len(seq.prompt), seq.key, 1)

    # ---- decode ----
    def _decode_window(self) -> None:
        """Up to `readback` decode steps over the running rows, then their tokens are read back (on CUDA without
        waiting: the window before this one is processed instead, so the GPU always has the next steps queued)."""
        n = len(self.running)
        live = self.issued[:n] < self.limit[:n]  # rows that may still sample (as far as the host knows)
        steps = min(self.readback, int((self.limit[:n] - self.issued[:n])[live].max(initial=0)))
        cache = self.cache
        for _ in range(steps):
            fault_point("engine.step")
            bucket = bucket_for(n, self.buckets)
            self.step(bucket, cache.decode_spans(bucket, self.span_granularity))
            cache.advance_host(bucket)
            live = self.issued[:n] < self.limit[:n]
            rows = np.flatnonzero(live)
            self.kept_log[rows, self.issued[rows]] = cache.fill_host[:, rows].sum(axis=0)
            self.peak_log[rows, self.issued[rows]] = cache.fill_host[:, rows].max(axis=0)
            self.issued[:n] += live
            self.stats.forwards += 1
            if self.engine.kv_trace is not None:
                for row in rows:
                    seq = self.running[row]
                    self._trace(row, [seq], [len(seq.prompt) + int(self.issued[row]) - 2])
            self._compress_due(n)
        if steps:
            self.pending.append(self._queue_readback(n, steps))
        while self.pending and (len(self.pending) > 1 or steps == 0 or self.readback == 1):
            self._process(self.pending.popleft())

    def _compress_due(self, n: int) -> None:
        """Compress every running row whose cache reached the trigger, in one batched call. Rows whose sequence the
        host knows has ended are left alone; one that ended unseen still compresses (its record drops it)."""
        if not self.kv.enabled:
            return
        fullest = self.cache.fill_host[:, :n].max(axis=0)
        due = np.flatnonzero((fullest >= self.trigger) & (self.issued[:n] < self.limit[:n]))
        if len(due):
            self._compress_rows(due.tolist(), [[self.running[r]] for r in due])

    def _compress_rows(self, rows: list[int], owners: list[list[Sequence]]) -> None:
        """Compress `rows` to their layer budgets, batched over rows (scores, top-k, gather): the rows must hold the
        same number of slots in each layer (rows that compress together do: they reached the trigger together, or
        it is one prefilled prompt). owners[i] are the sequences that record the compression of rows[i]."""
        cache = self.cache
        index = _device_index(rows, self.device)
        m = min(self.kv.window, int(cache.seen_host[rows].min()))
        sizes = [int(cache.fill_host[layer, rows[0]]) for layer in range(cache.num_layers)]
        # Scoring builds [rows, heads, n, n] similarities (R-KV): rows go in chunks whose scratch fits a cache-sized
        # budget on CPU (batched, 8 rows at n = 640 ran 2.4x slower than one by one: memory-bound) and a memory
        # bound on CUDA
        per_row = 4 * cache.key[0].shape[1] * max(sizes) ** 2
        chunk = max(1, (SCORE_SCRATCH_BYTES[self.device.type == "cuda"]) // per_row)
        parts = []
        for part in index.split(chunk):
            parts.append(compress_indices(
                self.kv,
                [cache.layer_keys(part, layer, n) for layer, n in enumerate(sizes)],
                [cache.window_queries(part, layer, m) for layer in range(cache.num_layers)],
                attn_mass=[cache.layer_mass(part, layer, n) for layer, n in enumerate(sizes)] if cache.tracks_mass
                else None,
                budget=self.budgets,
            ))  # per layer [chunk, Hkv, B_l]
        kept = [torch.cat(per_layer) for per_layer in zip(*parts)]
        cache.compact(index, rows, kept)
        # the eviction record: what every owner's later tokens can see (host copies that do not wait)
        held = [_to_host(cache.positions[layer][index, :, : k.shape[-1]]) for layer, k in enumerate(kept)]
        for i, (row, seqs) in enumerate(zip(rows, owners)):
            # tokens run before it: while prefilling, the prompt tokens so far; after, all but the last sampled one
            start = len(seqs[0].prompt) + int(self.issued[row]) - 1 if self.issued[row] else seqs[0].processed
            event = [h[i] for h in held]
            for seq in seqs:
                seq.evictions.append((start, event))
        self.stats.compressions += len(rows)

    def _queue_readback(self, n: int, steps: int) -> "_Readback":
        st = self.state
        tokens, logprobs = _to_host(st.out_tokens[:n, :steps]), _to_host(st.out_logprobs[:n, :steps])
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        st.column.zero_()
        return _Readback(list(self.running), tokens, logprobs, event)

    def _process(self, readback: "_Readback") -> None:
        """Hand the tokens of a readback window to their sequences, stopping each at its end."""
        if readback.event is not None:
            readback.event.synchronize()
        for seq, tokens, logprobs in zip(readback.sequences, readback.tokens.tolist(), readback.logprobs.tolist()):
            for token, logprob in zip(tokens, logprobs):
                if seq.finished:
                    break
                self._append(seq, token, logprob)

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        seq.append(token, logprob)
        if token in self.stop_ids:
            seq.finish_reason = "stop"
        elif len(seq.response) >= self.params.max_new_tokens or seq.length >= self.context:
            seq.finish_reason = "length"

    def _trace(self, row: int, seqs: list[Sequence], positions) -> None:
        if self.engine.kv_trace is None:
            return
        per_layer = [h.cpu() for h in self.cache.held_positions(row)]
        # [L, Hkv, n] when every layer holds n slots; per-layer budgets: one [Hkv, n_l] per layer
        held = torch.stack(per_layer) if len({h.shape[-1] for h in per_layer}) == 1 else per_layer
        for seq in seqs:
            self.engine.kv_trace(KVTraceRecord(seq.index, list(positions), held))

    def _retire(self, outputs: list[GenerationOutput | None]) -> None:
        """Hand out finished sequences; keep the running ones in rows [0, n) by moving the last row down."""
        for row in range(len(self.running) - 1, -1, -1):
            seq = self.running[row]
            if not seq.finished:
                continue
            n = len(seq.response)
            outputs[seq.index] = seq.output(self.engine.weight_version, self.kept_log[row, :n].tolist(),
                                            self.peak_log[row, :n].tolist(), self.cache.num_layers)
            last = len(self.running) - 1
            if row != last:
                self._move_row(last, row)
                self.running[row] = self.running[last]
            self.running.pop()
            self.cache.park_row(last)

    def _move_row(self, src: int, dst: int) -> None:
        self.cache.copy_row(src, dst)
        self.state.copy_row(src, dst)
        for host in (self.issued, self.limit, self.kept_log, self.peak_log):
            host[dst] = host[src]


@dataclass
class _Readback:
    """A decode window's tokens on their way to the host: row r of the window belonged to sequences[r]."""

    sequences: list[Sequence]
    tokens: Tensor  # [n, steps]
    logprobs: Tensor
    event: "torch.cuda.Event | None"


def _device_index(rows: list[int], device: torch.device) -> Tensor:
    """Row numbers as an index tensor on `device`, copied without waiting for the device (pinned memory on CUDA:
    a copy from pageable memory would first wait for every queued kernel)."""
    index = torch.tensor(rows, dtype=torch.int64)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index


def _to_host(t: Tensor) -> Tensor:
    """A host copy of `t` that does not wait for the device (pinned memory; valid once the stream gets there)."""
    if t.device.type != "cuda":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _eos_ids(model: nn.Module) -> set[int]:
    """EOS ids from the generation config (what generate() stops on), else from the model config."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    return set()


def _check_model(model: nn.Module) -> None:
    """The engine relies on full attention dispatched through transformers' AttentionInterface."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} is not supported: the engine needs a transformers causal LM whose attention "
            "uses the AttentionInterface (Qwen2/Qwen2.5, Llama, ...)"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(f"{cfg.model_type}: layer types {other} are not supported (full attention only)")
    for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        if getattr(cfg, name, None) is None:
            raise ValueError(f"{cfg.model_type}: config has no {name}")
