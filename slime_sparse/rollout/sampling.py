"""Sampling parameters and the pure functions that turn next-token logits into tokens and log-probs.

Log-prob convention (what Sparse-RL calls pi_sparse, and what SGLang / slime record): the log-prob of a
sampled token is ``log_softmax(logits / temperature)[token]``, taken at the sampling temperature but BEFORE
top-k / top-p truncation; truncation only decides which tokens may be drawn. With temperature 0 (greedy)
the token is the argmax and its log-prob comes from the untempered ``log_softmax(logits)``. The learner
recomputes pi_old with the same formula (dense context, same temperature), so the two are comparable.
"""
from __future__ import annotations

import logging
import math
import struct
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slime_sparse.rollout import sampling_kernel
from slime_sparse.rollout.counter_hash import GOLDEN as _GOLDEN
from slime_sparse.rollout.counter_hash import MIX1 as _MIX1
from slime_sparse.rollout.counter_hash import MIX2 as _MIX2
from slime_sparse.rollout.counter_hash import VOCAB_STEP as _VOCAB_STEP
from slime_sparse.utils.lm_head import tempered_log_softmax

_MASK64 = (1 << 64) - 1
_logger = logging.getLogger(__name__)
_KERNEL_REFUSED = False  # enable_kernel found the kernel unusable in this process


@dataclass(frozen=True)
class SamplingParams:
    """How a rollout engine samples; field names follow slime's --rollout-* flags."""

    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; 0: greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling; 1: off"})
    top_k: int = field(default=-1, metadata={"help": "top-k sampling; -1 (or 0): off"})
    max_new_tokens: int = field(default=1024, metadata={"help": (
        "response budget in tokens (slime: none, the engine's context limit); 1024 here, as slime's Qwen2.5 "
        "example: the embedded engine sizes its cache by it")})
    stop_token_ids: tuple[int, ...] = field(default=(), metadata={"help": (
        "token ids that end a response; unset: the EOS of the tokenizer in --hf-checkpoint")})
    ignore_eos: bool = field(default=False, metadata={"help": (
        "do not stop at the model's EOS (explicit --rollout-stop-token-ids still stop)")})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending flag."""
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"--rollout-temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--rollout-top-p={self.top_p!r} must lie in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"--rollout-top-k={self.top_k!r} must be -1 (off), 0 (off) or a positive integer")
        if self.max_new_tokens < 1:
            raise ValueError(f"--rollout-max-response-len={self.max_new_tokens!r} must be >= 1")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"--rollout-stop-token-ids contains invalid ids {bad}: token ids are integers >= 0")


def derive_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for sample `index` of a call seeded with `seed` (splitmix64 finaliser).

    Each sample's random stream is keyed by it (`counter_stream`), so its tokens depend only on (seed, index) and
    not on the batch size or on which other prompts share its decode steps.
    """
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def apply_top_k(logits: Tensor, top_k: int) -> Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties with the k-th survive). k <= 0 = off."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, top_p: float) -> Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches top_p.

    A token survives when the mass of the tokens ranked strictly above it is < top_p, so the top token
    always survives. top_p >= 1 = off.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampler_logprobs(logits: Tensor, temperature: float) -> Tensor:
    """Full log-distribution the sampler records: log_softmax(logits / T) (untempered for T = 0), float32; the
    learners' formula (`utils.lm_head.tempered_log_softmax`)."""
    return tempered_log_softmax(logits, temperature)


def truncate(tempered: Tensor, params: SamplingParams) -> Tensor:
    """Tempered logits after top-k then top-p (transformers' order): what tokens are drawn from. Off: `tempered`."""
    return apply_top_p(apply_top_k(tempered, params.top_k), params.top_p)




def _mix(z: Tensor) -> Tensor:
    """Two xorshift-multiply rounds of splitmix64's finaliser, in int64 that wraps like uint64, in place on `z` (a
    fresh tensor: at [rows, vocab] one int64 temporary beside it, not three). The shifts are torch's arithmetic ones
    (one op each instead of two for a logical shift): the sign bit is lost once per round, a map from 64 bits to 63,
    and the multiply spreads what is left over the high bits that are read out."""
    z.bitwise_xor_(z >> 30).mul_(_MIX1)
    return z.bitwise_xor_(z >> 27).mul_(_MIX2)


def counter_stream(keys: Tensor, counters: Tensor) -> Tensor:
    """[n] int64: the state of token `counters[i]` of the sample keyed `keys[i]`, a pure function of the two.

    Keyed by the sample's stream key (`derive_seed(seed, sample index)`) and the token's index in the response, a
    sample's draws depend on nothing else: not the batch row, the batch size, the step, nor a generator's state, so
    the decode step that draws them can be captured in a CUDA graph and compiled (`counter_stream_reference`: the
    same in Python integers).
    """
    return _mix(torch.add(keys, counters, alpha=_GOLDEN))


def gumbel_noise(streams: Tensor, vocab: int) -> Tensor:
    """[n, V] float32 standard Gumbel noise, entry (i, v) a pure function of (streams[i], v).

    The mixed stream + v * step gives 32 random bits b (the high ones); w = (b + 1/2) / 2^32 is uniform on (0, 1) and
    -log(-log1p(-w)) = -log(-log(1 - w)) is Gumbel, computed from the side of w near 0 where float32 keeps its
    resolution, so the noise reaches 22.9 before the 32 bits run out (SGLang's multinomial_with_seed and vLLM's
    Gumbel sampler use the same inverse; `gumbel_reference` is the oracle). An elementwise chain that torch.compile
    fuses into the argmax.
    """
    ids = torch.arange(1, vocab + 1, device=streams.device, dtype=torch.int64).mul_(_VOCAB_STEP)
    bits = _mix(streams[:, None] + ids).bitwise_right_shift_(32).bitwise_and_(0xFFFFFFFF)
    minus_w = bits.to(torch.float32).mul_(-1.0 / (1 << 32)).sub_(1.0 / (1 << 33))
    del bits  # in place from here on: the noise costs 4 bytes per logit once the bits are floats
    return torch.log1p(minus_w).neg_().log_().neg_()


@torch.library.custom_op("slime_sparse::gumbel_noise", mutates_args=())
def gumbel_noise_op(streams: Tensor, vocab: int) -> Tensor:
    """`gumbel_noise` as one opaque op, what a compiled step calls: inductor's CPU code for this int64 chain fused
    into the argmax that reads it crashes (a segfault, torch 2.13), and on CUDA the noise lives in the sampler
    kernel anyway."""
    return gumbel_noise(streams, vocab)


@gumbel_noise_op.register_fake
def _(streams: Tensor, vocab: int) -> Tensor:
    return streams.new_empty((streams.shape[0], vocab), dtype=torch.float32)


def _mix_reference(z: int) -> int:
    def sar(x: int, shift: int) -> int:  # arithmetic right shift of the int64 with bits x
        return ((x - (1 << 64) if x >> 63 else x) >> shift) & _MASK64

    z = ((z ^ sar(z, 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    return ((z ^ sar(z, 27)) * 0x94D049BB133111EB) & _MASK64


def counter_stream_reference(key: int, counter: int) -> int:
    """`counter_stream` for one (key, counter) in plain Python integers (unsigned): the oracle of its int64 arithmetic."""
    return _mix_reference((key + counter * 0x9E3779B97F4A7C15) & _MASK64)


def gumbel_reference(stream: int, vocab_id: int) -> float:
    """`gumbel_noise` of one (unsigned stream, vocab id) in Python integers, its float32 roundings, then float64."""
    bits = _mix_reference((stream + (vocab_id + 1) * 0xD1B54A32D192ED03) & _MASK64) >> 32
    minus_w = _f32(_f32(bits) * (-1.0 / (1 << 32)) - 1.0 / (1 << 33))
    return -math.log(-math.log1p(minus_w))


def _f32(x: float) -> float:
    """x rounded to float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """logits / T in float32, tempered_log_softmax's arithmetic; at T = 1 the logits themselves (x / 1 is x)."""
    return logits.float() if temperature == 1.0 else logits.float() / temperature


def sample_tokens(logits: Tensor, params: SamplingParams, keys: Tensor | None = None,
                  counters: Tensor | None = None, kernel=None) -> tuple[Tensor, Tensor]:
    """Draw one token per row of `logits` [n, V]; return (tokens [n] long, their recorded log-probs [n] float32).

    Greedy (temperature 0) is the argmax. Otherwise Gumbel-max: row i takes argmax(truncated logits / T + noise), the
    noise `gumbel_noise(counter_stream(keys[i], counters[i]))` ([n] int64 tensors on the logits' device), a function of
    the sample's key, the token's index and the vocabulary id only. One pass over the vocabulary: the tempered logits
    feed both the recorded log-softmax and the draw (no softmax, no cumulative sum); top-k / top-p only mask what may
    be drawn. Free of host synchronisation and data-dependent Python, so a CUDA graph or torch.compile(fullgraph=True)
    can hold it. On CUDA, once `enable_kernel` has checked it (or given `kernel`, its `build()`), the draw and
    the log-prob are one Triton kernel that reads the logits once.
    """
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
        logp = sampler_logprobs(logits, 0.0)
    else:
        if keys is None or counters is None:
            raise ValueError("sample_tokens needs a stream key and a counter per row when temperature > 0")
        streams = counter_stream(keys, counters)
        truncates = params.top_k > 0 or params.top_p < 1.0
        if kernel is not None or sampling_kernel.enabled(logits):
            truncated = truncate(_tempered(logits, params.temperature), params) if truncates else None
            if kernel is not None:
                return kernel(logits, truncated, streams, params.temperature)
            return sampling_kernel.gumbel_sample(logits, truncated, streams, params.temperature)
        tempered = _tempered(logits, params.temperature)  # done once
        del logits  # not read again: a caller that hands them over frees them here
        logp = torch.log_softmax(tempered, dim=-1)
        noise = (gumbel_noise_op if torch.compiler.is_compiling() else gumbel_noise)(streams, tempered.shape[-1])
        tokens = torch.argmax((truncate(tempered, params) if truncates else tempered) + noise, dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def enable_kernel(device: torch.device) -> bool:
    """Build the kernel and use it for CUDA sampling from now on, if it reproduces the torch path's draws on
    `device` (tokens equal where no two scores are within float rounding, log-probs to 1e-5); False, with a warning
    naming what went wrong, otherwise."""
    global _KERNEL_REFUSED
    if sampling_kernel._KERNEL is not None or device.type != "cuda" or _KERNEL_REFUSED:
        return sampling_kernel._KERNEL is not None
    _KERNEL_REFUSED = True  # until the check below passes: a process builds and checks the kernel once
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    try:
        kernel = sampling_kernel.build()
        gen = torch.Generator().manual_seed(0)
        logits = (torch.randn(64, 3001, generator=gen) * 4).to(device)
        keys, counters = torch.randint(0, 2**62, (64,), generator=gen).to(device), torch.arange(64, device=device)
        for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=50, top_p=0.9)):
            want, want_logp = sample_tokens(logits, params, keys, counters)  # the torch path: _KERNEL is None
            got, got_logp = sample_tokens(logits, params, keys, counters, kernel=kernel)
            same = got == want
            agree, err = float(same.float().mean()), float((got_logp - want_logp)[same].abs().max())
            if not (agree >= 0.95 and err <= 1e-5):
                raise RuntimeError(f"{params}: {agree:.0%} of the tokens agree, log-prob error {err:.2g}")
    except Exception as exc:  # a kernel that does not build or agree here: keep the torch path
        _logger.warning("sampling: the Triton Gumbel kernel is not used: %s: %s", type(exc).__name__, exc)
        return False
    sampling_kernel.install(kernel)
    _KERNEL_REFUSED = False
    return True
