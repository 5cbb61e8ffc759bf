"""EmbeddedEngine: batched, budgeted-KV sampling over a transformers causal LM, in this process.

How a generate() call runs (nano-vllm's scheduler shape, without pages):
- one BudgetKVCache with max_batch_size rows is allocated for the call; running sequences always occupy
  rows [0, n_running), so every decode step reads plain views of the cache;
- continuous batching: whenever a sequence finishes, the last running row moves into its place and the
  next waiting prompt is admitted at the end, then prefilled (chunked when the cache bound demands it);
- each step runs the HF model once with explicit position_ids (the logical index of every token, so RoPE
  is never re-applied to kept keys), a 4D mask over cache slots and our cache as past_key_values;
- after the step each sequence that hit its trigger is compressed on its own (slime_sparse.kv.schedule).

KV bound. Compression on: a row holds at most budget + buffer slots at any time, during prefill too
(prompts longer than that are prefilled in chunks with compressions in between). Compression off (or a
budget above the longest possible sequence): the cache holds the whole sequence, exactly like dense decoding.
"""
from __future__ import annotations

import dataclasses
import os
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor, nn

from slime_sparse.kv import KVCompressConfig, compress_indices, row_capacity, should_compress
from slime_sparse.rollout.base import KVView, WeightSource
from slime_sparse.rollout.sampling import SamplingParams, derive_seed, sample_next
from slime_sparse.types import GenerationOutput, KVStats
from slime_sparse.utils.faults import fault_point

from .attention import CACHE_KWARG, budget_attention_installed
from .cache import BudgetKVCache
from .plan import StepPlan, build_plan, decode_plan
from .sequence import KVTraceRecord, Sequence

LONG_PROMPT_POLICIES = ("error", "skip")


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
    kv_trace: optional callback receiving a KVTraceRecord per sequence per forward (tests, debugging).
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
        self.model = _load_model(model_or_path, self.device, dtype)
        _check_model(self.model)
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
        i always draws from the generator of (seed, index_offset + i) whichever engine runs it.
        `kv`: generate under this KV config instead of the engine's own (a validated one: see `with_kv`)."""
        params.validate()
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        accepted = self._check_prompts(prompts, outputs)
        if accepted:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,)).item())  # follows torch.manual_seed
            sequences = [
                Sequence(index=i, prompt=[int(t) for t in prompts[i]],
                         generator=None if params.greedy else self._generator(seed, index_offset + i))
                for i in accepted
            ]
            with torch.inference_mode(), budget_attention_installed(self.model):
                _Run(self, sequences, params, self.kv if kv is None else kv).run(outputs)
        return outputs  # type: ignore[return-value]

    @staticmethod
    def _generator(seed: int, index: int) -> torch.Generator:
        # A CPU generator on every device: sampling draws one uniform per token (see sample_next), so the
        # stream is the same on CPU and GPU and costs one small host-to-device copy per step.
        return torch.Generator().manual_seed(derive_seed(seed, index))

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
        self.waiting = deque(sequences)
        self.running: list[Sequence] = []  # running[r] lives in cache row r
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else _eos_ids(self.model))
        self.context = self.model.config.max_position_embeddings
        longest = min(max(len(s.prompt) for s in sequences) + params.max_new_tokens, self.context)
        self.capacity = row_capacity(self.kv, longest)
        self.cache = self._allocate(min(engine.max_batch_size, len(sequences)))
        self.stats = engine.last_stats = GenerateStats(kv_cache_bytes=self.cache.kv_bytes)

    def _allocate(self, rows: int) -> BudgetKVCache:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return BudgetKVCache(
            num_layers=cfg.num_hidden_layers,
            num_rows=rows,
            num_kv_heads=cfg.num_key_value_heads,
            num_q_heads=cfg.num_attention_heads,
            head_dim=head_dim,
            capacity=self.capacity,
            window=self.kv.window,
            record_queries=self.kv.enabled,
            track_mass=self.kv.traits.tracks_mass,
            device=self.engine.device,
            dtype=self.model.dtype,
        )

    def run(self, outputs: list[GenerationOutput | None]) -> None:
        rows = len(self.cache.fill)
        while self.waiting or self.running:
            admitted: list[Sequence] = []
            while self.waiting and len(self.running) + len(admitted) < rows:
                admitted.append(self.waiting.popleft())
            if admitted:
                self._admit(admitted)
                self._retire(outputs)
            if self.running:
                self._decode()
                self._retire(outputs)

    # ---- prefill ----
    def _admit(self, admitted: list[Sequence]) -> None:
        """Prefill the admitted prompts, each distinct prompt once (GRPO's n samples of a prompt share it), and
        sample their first tokens.

        The first sample of each prompt (its leader) is prefilled in a row of its own; the others (followers) get a
        copy of that row once the prompt is done, before any decode-time compression, so they continue from the very
        cache they would have built themselves. Leaders fill rows [first, first + n_leaders), followers the rows after.
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
        prefill = sum(len(s.prompt) for s in leaders)
        self.stats.prefill_tokens += prefill
        self.stats.prefill_tokens_saved += sum(len(s.prompt) for s in admitted) - prefill
        follower_rows, row = {}, first + len(leaders)
        for leader in leaders:
            follower_rows[id(leader)] = range(row, row + len(followers[id(leader)]))
            row += len(followers[id(leader)])
        while any(s.processed < len(s.prompt) for s in leaders):
            rows = range(first, first + len(leaders))
            chunks = [s.pending(self.capacity - self.cache.fill[r]) if s.processed < len(s.prompt) else []
                      for s, r in zip(leaders, rows)]
            logits = self._forward(first, chunks, [s.processed for s in leaders])
            for b, (seq, row, chunk) in enumerate(zip(leaders, rows, chunks)):
                if not chunk:
                    continue  # prompt already done: this row only rode along
                self._account(seq, row, len(chunk), followers[id(seq)])
                if seq.processed < len(seq.prompt):
                    if should_compress(self.cache.fill[row], self.kv):  # a long prompt, prefilled in chunks
                        self._compress_rows([row], [[seq]])
                    continue
                group = [seq] + followers[id(seq)]
                for f in followers[id(seq)]:
                    f.processed, f.kv, f.evictions = seq.processed, dataclasses.replace(seq.kv), list(seq.evictions)
                self._sample(group, logits[b].expand(len(group), -1))
                live = [s for s in group if not s.finished]
                if live and should_compress(self.cache.fill[row], self.kv, first_decode=True):
                    self._compress_rows([row], [live])
                for f, f_row in zip(followers[id(seq)], follower_rows[id(seq)]):
                    if not f.finished:
                        self.cache.copy_row(row, f_row)

    # ---- decode ----
    def _decode(self) -> None:
        """One decode step: every running sequence runs its one pending token (the one sampled last)."""
        seqs, cache = self.running, self.cache
        n = len(seqs)
        plan = decode_plan([s.response[-1] for s in seqs], cache.fill[:n], [s.processed for s in seqs],
                           cache.queries_seen[:n], self.kv.window, self.engine.device)
        logits = self._run_plan(plan, [1] * n)
        for row, seq in enumerate(seqs):
            self._account(seq, row, 1, ())
        self._sample(seqs, logits)
        due = [row for row, seq in enumerate(seqs) if not seq.finished and should_compress(cache.fill[row], self.kv)]
        if due:
            self._compress_rows(due, [[seqs[row]] for row in due])

    # ---- shared by both ----
    def _forward(self, row_start: int, chunks: list[list[int]], first_positions: list[int]) -> Tensor:
        """Run each row's chunk through the model (rows [row_start, row_start + len(chunks))); next-token logits
        of every row's last column."""
        cache = self.cache
        rows = range(row_start, row_start + len(chunks))
        plan = build_plan(row_start, chunks, [cache.fill[r] for r in rows], first_positions,
                          [cache.queries_seen[r] for r in rows], self.kv.window, self.engine.device)
        return self._run_plan(plan, [len(c) for c in chunks])

    def _run_plan(self, plan: StepPlan, chunk_lengths: list[int]) -> Tensor:
        fault_point("engine.step")  # chaos tests: a kill mid-rollout (prefill or decode)
        cache = self.cache
        cache.begin(plan)
        logits = self.model(
            input_ids=plan.input_ids, position_ids=plan.position_ids, attention_mask=plan.attn_mask,
            past_key_values=cache, use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache},
        ).logits[:, -1]
        cache.commit(chunk_lengths)
        self.stats.forwards += 1
        return logits

    def _account(self, seq: Sequence, row: int, ran: int, followers) -> None:
        """After `ran` tokens of `seq` went through the model in `row`: progress, KV stats, trace."""
        seq.processed += ran
        fill = self.cache.fill[row]
        seq.kv.peak_kv_tokens = max(seq.kv.peak_kv_tokens, fill)
        if self.engine.kv_trace is not None:
            positions = list(range(seq.processed - ran, seq.processed))
            for s in (seq, *followers):
                self.engine.kv_trace(KVTraceRecord(s.index, positions, self.cache.held_positions(row)))
        if seq.processed == seq.length:
            # The logits of this token see `processed` tokens densely and `fill` through our cache.
            seq.kv.dense_kv_tokens += seq.processed
            seq.kv.kept_kv_tokens += fill

    def _sample(self, seqs: list[Sequence], logits: Tensor) -> None:
        generators = None if self.params.greedy else [s.generator for s in seqs]
        tokens, logprobs = sample_next(logits, self.params, generators)
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.append(token, logprob)
            if token in self.stop_ids:
                seq.finish_reason = "stop"
            elif len(seq.response) >= self.params.max_new_tokens or seq.length >= self.context:
                seq.finish_reason = "length"

    def _compress_rows(self, rows: list[int], owners: list[list[Sequence]]) -> None:
        """Compress each of `rows` to the budget; owners[i] are the sequences that count the compression."""
        cache = self.cache
        for row, seqs in zip(rows, owners):
            kept = compress_indices(
                self.kv, cache.layer_keys(row), cache.window_queries(row), values=cache.layer_values(row),
                attn_mass=cache.layer_mass(row), budget=self.kv.budget,
            )
            cache.compact(row, kept)
            held = cache.held_positions(row)  # the eviction record: what every owner's later tokens can see
            for seq in seqs:
                seq.evictions.append((seq.processed, held))
                seq.kv.compressions += 1
        self.stats.compressions += len(rows)

    def _retire(self, outputs: list[GenerationOutput | None]) -> None:
        """Hand out finished sequences; keep the running ones in rows [0, n) by moving the last row down."""
        for row in range(len(self.running) - 1, -1, -1):
            seq = self.running[row]
            if not seq.finished:
                continue
            outputs[seq.index] = seq.output(self.engine.weight_version)
            last = len(self.running) - 1
            if row != last:
                self.cache.copy_row(last, row)
                self.running[row] = self.running[last]
            self.running.pop()


def _eos_ids(model: nn.Module) -> set[int]:
    """EOS ids from the generation config (what generate() stops on), else from the model config."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    return set()


def _load_model(
    model_or_path: nn.Module | str | os.PathLike, device: torch.device, dtype: torch.dtype | None
) -> nn.Module:
    if isinstance(model_or_path, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        if not os.path.isdir(model_or_path):
            raise ValueError(f"model path {os.fspath(model_or_path)!r} is not a local directory (--hf-checkpoint)")
        model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=dtype or torch.float32)
    else:
        model = model_or_path
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device=device)
    return model.eval()


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
