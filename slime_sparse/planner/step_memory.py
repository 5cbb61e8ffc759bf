"""What one colocated RL step holds on its device, phase by phase: the rollout engine's weights and KV cache, the
learner's weights, gradients and optimizer state, and each learner micro-batch's activations, with and without
activation recompute. Pure arithmetic on a `ModelShape`, like the rollout's and the learner state's beside it (memory.py).

The learner terms follow what the embedded learner's autograd graph keeps (a Hugging Face Qwen2 / Llama / Qwen3
decoder under SDPA, the LM head on the response positions only: `backends.logprobs`), counted tensor by tensor
below and checked against torch's own memory tracker on CPU (tests/planner/test_step_memory.py):
- per token and decoder layer, what backward reads: each RMSNorm's fp32 upcast and normed output, the query, the
  keys and values SDPA saves (repeated to every query head when a padding mask is present, which disables SDPA's
  GQA), the attention output and its copy for o_proj, the logsumexp, and the SwiGLU MLP's gate, up, act and
  act * up; a padded micro-batch adds SDPA's mask (one element per key, per token and layer);
- with activation recompute (`--recompute-granularity full`: torch's checkpoint per layer, Megatron's
  uniform recompute of one layer per chunk) a layer keeps only its input; backward recomputes one layer at a time;
- the LM head on the R response positions of a micro-batch: the fp32 tempered log-softmax [R, V] is kept for
  backward, whose peak holds three such tensors (the kept output, its incoming gradient and the outgoing one) and
  the head weight's gradient while it is added to the accumulated one;
  the no-grad recompute peaks at two (the fp32 logits and their tempered copy, then the log-softmax).
Megatron's learner keeps the same per-layer tensors plus, on its local layer spec (no Transformer Engine), the
unfused attention's probabilities (heads x sequence bytes per token and layer) unless
`--recompute-granularity selective` recomputes them, and logits for every position (not only the response's).
"""
from __future__ import annotations

from dataclasses import dataclass

from slime_sparse.kv.config import KVCompressConfig
from slime_sparse.kv.engine_memory import KV_PART, EngineSpec, Sampler, engine_bytes
from slime_sparse.utils.model_shape import ModelShape

RECOMPUTE = (None, "selective", "full")
FP32 = 4


def layer_saved_bytes(shape: ModelShape, dtype_bytes: int, *, padded: bool, seq_len: int = 0,
                      unfused_attention: bool = False) -> int:
    """Bytes one decoder layer keeps for backward per token (see the module docstring). `padded`: the micro-batch
    has a padding mask (rows of different lengths): keys and values are repeated to every query head and SDPA
    keeps the mask (`seq_len` keys per token). `unfused_attention`: Megatron's local attention, which keeps the
    softmax probabilities (heads x `seq_len` per token)."""
    b, h, d = dtype_bytes, shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * d, (shape.num_heads if padded else shape.num_kv_heads) * d
    norms = 2 * (FP32 + 2 * b) * h  # input and post-attention RMSNorm: fp32 upcast, normed, times weight
    if shape.qk_norm:  # Qwen3's per-head RMSNorm of queries and keys: fp32 upcast and normed
        norms += (FP32 + b) * (shape.num_heads + shape.num_kv_heads) * d
    attention = b * (q + 2 * kv) + 2 * b * q + FP32 * shape.num_heads  # q, k, v; output and o_proj's copy; lse
    if padded:
        attention += b * seq_len
    if unfused_attention:
        attention += b * shape.num_heads * seq_len
    mlp = 4 * b * shape.intermediate_size  # gate, up, silu(gate), silu(gate) * up
    return norms + attention + mlp


def head_bytes(shape: ModelShape, *, training: bool, entropy: bool = False) -> int:
    """Peak bytes of the LM head per response token: fp32 [V] tensors, three during backward (training: the kept
    log-softmax, its incoming gradient, the outgoing one), two in a no-grad recompute (the logits and their tempered
    copy, then that copy and its log-softmax); the entropy term keeps exp(log-softmax) as well."""
    return FP32 * shape.vocab_size * ((3 + (1 if entropy else 0)) if training else 2)


@dataclass(frozen=True)
class MicroBatch:
    """One learner micro-batch: `tokens` padded tokens (rows x longest row, what --max-tokens-per-gpu counts),
    `response_tokens` of them padded response positions (rows x longest response), rows of `seq_len` tokens."""

    tokens: int
    response_tokens: int
    seq_len: int
    padded: bool = True

    @classmethod
    def fill(cls, max_tokens: int, prompt_len: int, response_len: int) -> "MicroBatch":
        """A micro-batch packed to `max_tokens` with rows of `prompt_len` + `response_len` tokens (at least one row)."""
        seq = prompt_len + response_len
        rows = max(1, max_tokens // seq)
        return cls(rows * seq, rows * response_len, seq, padded=True)


def train_activation_bytes(shape: ModelShape, mb: MicroBatch, *, dtype_bytes: int, recompute: str | None = None,
                           unfused_attention: bool = False, entropy: bool = False) -> int:
    """Peak bytes one training micro-batch adds on top of weights, gradients and optimizer state: its forward's
    saved tensors, then the larger of the LM head's backward (every layer's tensors still kept) and one layer's
    recompute + backward under activation recompute."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    h, layers = shape.hidden_size, shape.num_layers
    per_layer = layer_saved_bytes(shape, dtype_bytes, padded=mb.padded, seq_len=mb.seq_len,
                                  unfused_attention=unfused_attention and recompute is None)
    final = (FP32 + 2 * dtype_bytes) * h * mb.tokens + dtype_bytes * h * mb.response_tokens  # final norm, picked rows
    # the head weight's gradient as it is accumulated into .grad: up to three [V, H] tensors at once (measured with a
    # tied embedding: the new gradient, the embedding's share, their sum)
    head = head_bytes(shape, training=True, entropy=entropy) * mb.response_tokens \
        + 3 * dtype_bytes * shape.vocab_size * h
    if recompute == "full":
        kept = layers * dtype_bytes * h * mb.tokens  # each layer's input
        return kept + final + max(head, per_layer * mb.tokens)
    return layers * per_layer * mb.tokens + final + head


def recompute_activation_bytes(shape: ModelShape, mb: MicroBatch, *, dtype_bytes: int) -> int:
    """Peak bytes of one no-grad log-prob micro-batch (dense recompute of pi_old / pi_ref): the final hidden states
    and the LM head's two fp32 [V] tensors per response token (a layer's own working set is smaller)."""
    return dtype_bytes * shape.hidden_size * (mb.tokens + mb.response_tokens) \
        + head_bytes(shape, training=False) * mb.response_tokens


LEARNERS = ("embedded", "megatron")


@dataclass(frozen=True)
class StepSpec:
    """One colocated RL step on one device: the rollout engine and the learner share it (TP 1, DP 1)."""

    seqs: int  # samples of the rollout (prompts x samples per prompt)
    prompt_len: int
    response_len: int
    engine_rows: int  # sequences the engine decodes at once (--rollout-max-batch-size)
    kv_slots: int  # KV slots of one engine row (schedule.row_capacity: budget + buffer, or the whole sequence)
    kv_window: int = 0  # queries each compressing row keeps for scoring (0: dense)
    max_tokens_per_gpu: int = 16384
    recompute: str | None = None  # --recompute-granularity
    dtype_bytes: int = 2  # weights and activations of both (bf16: 2)
    learner: str = "embedded"
    offload_rollout: bool = True  # the engine's KV cache is given back while the learner works (--offload-rollout)
    with_ref: bool = False  # a frozen reference model (--use-kl-loss with a coefficient)
    entropy: bool = False  # --entropy-coef != 0
    kv: KVCompressConfig | None = None  # the rollout's compression (None: R-KV if kv_window > 0, else dense)

    def __post_init__(self) -> None:
        if self.learner not in LEARNERS:
            raise ValueError(f"learner must be one of {LEARNERS}, got {self.learner!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if min(self.seqs, self.prompt_len, self.response_len, self.engine_rows, self.kv_slots,
               self.max_tokens_per_gpu) < 1:
            raise ValueError(f"every size of a step must be >= 1, got {self}")

    @property
    def micro_batch(self) -> MicroBatch:
        return MicroBatch.fill(self.max_tokens_per_gpu, self.prompt_len, self.response_len)

    def engine(self, shape: ModelShape) -> EngineSpec:
        """The in-process engine of the rollout phase as its own admission counts it (kv/engine_memory.py): on a GPU,
        with CUDA graphs, reading back every 8 steps, sampling at the trainer's defaults with the one-kernel sampler,
        decoding through our body (Qwen2 / Llama: not Qwen3's query / key norms) with the Triton decode attention."""
        kv = self.kv
        if kv is None and self.kv_window:  # R-KV holding kv_slots = budget + buffer, in the default's proportions
            default = KVCompressConfig()
            buffer = max(1, self.kv_slots * default.buffer // (default.budget + default.buffer))
            kv = KVCompressConfig(method="rkv", budget=self.kv_slots - buffer, buffer=buffer, window=self.kv_window)
        kv = kv or KVCompressConfig()
        return EngineSpec(shape, kv, self.kv_slots, min(self.prompt_len, self.kv_slots), self.dtype_bytes,
                          Sampler(fused=True), graphs=True, readback=8, decode_body=not shape.qk_norm,
                          decode_attention="triton")


PHASES = ("rollout", "recompute", "train", "weight update")


def plan_step(shape: ModelShape, step: StepSpec) -> dict[str, dict[str, int]]:
    """{phase: {part: bytes}} of a colocated step, for each of PHASES; a phase's peak is the sum of its parts.

    Held throughout: both copies of the weights (the engine's and the learner's, plus a frozen reference), the
    optimizer state (embedded: torch AdamW's two moments in the weights' dtype; Megatron: fp32 master weights and
    moments) and the gradients (embedded: in the weights' dtype, kept from one step to the next; Megatron: its fp32
    buffer). The engine's KV cache and row state count in the rollout phase, and in every other one unless the
    engine gives them back (`offload_rollout`). Rollout adds the engine's working sets, as its admission counts them
    (`engine_memory.engine_bytes`: a decode step's logits and sampler, a prefill, a compaction's workspace); the
    weight update adds, for Megatron, the exported copy it hands to the engine at once (the embedded learner's
    tensors are copied in place)."""
    b, p = step.dtype_bytes, shape.num_parameters()
    embedded = step.learner == "embedded"
    held = {"engine weights": p * b, "learner weights": p * b * (2 if step.with_ref else 1),
            "optimizer": p * (2 * b if embedded else 12), "gradients": p * (b if embedded else FP32)}
    engine = engine_bytes(step.engine(shape), min(step.engine_rows, step.seqs))
    idle_kv = {} if step.offload_rollout else {"KV cache (kept)": engine[KV_PART]}
    mb = step.micro_batch
    unfused = not embedded  # Megatron's local spec (no Transformer Engine on the planned machine)
    if embedded:
        recompute = recompute_activation_bytes(shape, mb, dtype_bytes=b)
    else:  # logits of every position of the micro-batch
        recompute = recompute_activation_bytes(shape, MicroBatch(mb.tokens, mb.tokens, mb.seq_len), dtype_bytes=b)
    train_mb = mb if embedded else MicroBatch(mb.tokens, mb.tokens, mb.seq_len)
    activations = train_activation_bytes(shape, train_mb, dtype_bytes=b, recompute=step.recompute,
                                         unfused_attention=unfused, entropy=step.entropy)
    if embedded:  # torch AdamW's foreach step makes sqrt(v) for every parameter at once, after the activations
        activations = max(activations, p * b)
    train = {"micro-batch activations": activations}
    return {
        "rollout": {**held, **engine},
        "recompute": {**held, **idle_kv, "micro-batch activations": recompute},
        "train": {**held, **idle_kv, **train},
        "weight update": {**held, **idle_kv, **({} if embedded else {"exported copy": p * b})},
    }


def phase_peaks(plan: dict[str, dict[str, int]]) -> dict[str, int]:
    return {phase: sum(parts.values()) for phase, parts in plan.items()}


def largest_micro_batch(shape: ModelShape, step: StepSpec, device_bytes: int) -> int | None:
    """The largest --max-tokens-per-gpu (a whole number of rows of this step's length) with which the learner's
    phases (recompute, train) fit `device_bytes`; None when not even one row fits."""
    seq = step.prompt_len + step.response_len
    best = None
    lo, hi = 1, max(1, step.seqs)
    while lo <= hi:  # the peak grows with the rows of a micro-batch
        rows = (lo + hi) // 2
        trial = StepSpec(**{**step.__dict__, "max_tokens_per_gpu": rows * seq})
        peaks = phase_peaks(plan_step(shape, trial))
        if max(peaks["recompute"], peaks["train"]) <= device_bytes:
            best, lo = rows * seq, rows + 1
        else:
            hi = rows - 1
    return best
