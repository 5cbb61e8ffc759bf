"""The Gumbel-max sampler of `sampling.sample_tokens` as one Triton kernel: one pass over each row's logits.

A program per row streams its vocabulary in blocks and keeps, in registers, the online log-sum-exp of the tempered
logits (for the recorded log-prob) and the running argmax of (truncated) tempered logit + Gumbel noise, the noise
computed in the kernel from the row's counter stream with `sampling.gumbel_noise`'s integer arithmetic (the same bits;
its log1p by Kahan's formula, within an ulp or two of torch's). It writes a token and a log-prob per row: the logits
are read once, where the torch path makes ~20 passes over [rows, vocab] tensors (int64 ones among them) unless
torch.compile fuses them. Used on CUDA once `enable` has built it and checked it against the torch path; CPU and
meta (tests, the capture guard) keep the torch path. Triton >= 3.0 language only (the GPU image has 3.6); a test
builds the kernel under TRITON_INTERPRET=1 and passes it in.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)
BLOCK_V = 1024
_KERNEL = None  # set by `sampling.enable_kernel` on a device where the kernel builds and agrees with the torch path


def build():
    import triton
    import triton.language as tl

    from .counter_hash import MIX1 as _MIX1, MIX2 as _MIX2, VOCAB_STEP as _VOCAB_STEP

    @triton.jit
    def gumbel_kernel(logits_ptr, trunc_ptr, stream_ptr, token_ptr, logp_ptr, temperature, vocab, s_logits, s_trunc,
                      HAS_TRUNC: tl.constexpr, BLOCK: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr,
                      STEP: tl.constexpr):
        row = tl.program_id(0)
        stream = tl.load(stream_ptr + row)
        top = float("-inf")
        total = 0.0
        best = float("-inf")
        best_id = 0
        for start in range(0, vocab, BLOCK):
            ids = start + tl.arange(0, BLOCK)
            ok = ids < vocab
            tempered = tl.load(logits_ptr + row * s_logits + ids, mask=ok, other=float("-inf")).to(tl.float32)
            tempered = tempered / temperature
            new_top = tl.maximum(top, tl.max(tempered, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(tempered - new_top), 0)
            top = new_top
            if HAS_TRUNC:
                drawn = tl.load(trunc_ptr + row * s_trunc + ids, mask=ok, other=float("-inf"))
            else:
                drawn = tempered
            z = stream + (ids + 1).to(tl.int64) * STEP
            z = (z ^ (z >> 30)) * MIX1
            z = (z ^ (z >> 27)) * MIX2
            minus_w = ((z >> 32) & 0xFFFFFFFF).to(tl.float32) * (-1.0 / 4294967296.0) - (1.0 / 8589934592.0)
            one = 1.0 + minus_w  # Kahan: log1p(x) = log(1 + x) * x / ((1 + x) - 1), exact where 1 + x rounds to 1
            log1p = tl.where(one == 1.0, minus_w, tl.log(one) * (minus_w / (one - 1.0)))
            score = tl.where(ok, drawn - tl.log(-log1p), float("-inf"))
            block_best = tl.max(score, 0)
            block_id = start + tl.argmax(score, 0)  # the first maximum, as torch.argmax
            better = block_best > best  # strict: an equal score later in the vocabulary loses, as in torch.argmax
            best_id = tl.where(better, block_id, best_id)
            best = tl.where(better, block_best, best)
        chosen = tl.load(logits_ptr + row * s_logits + best_id).to(tl.float32) / temperature
        tl.store(token_ptr + row, best_id.to(tl.int64))
        tl.store(logp_ptr + row, chosen - (top + tl.log(total)))

    def launch(logits: Tensor, truncated: Tensor | None, streams: Tensor, temperature: float
               ) -> tuple[Tensor, Tensor]:
        n, vocab = logits.shape
        tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        trunc = logits if truncated is None else truncated
        gumbel_kernel[(n,)](logits, trunc, streams, tokens, logp, temperature, vocab, logits.stride(0),
                            trunc.stride(0), HAS_TRUNC=truncated is not None, BLOCK=BLOCK_V, MIX1=_MIX1, MIX2=_MIX2,
                            STEP=_VOCAB_STEP)
        return tokens, logp

    return launch


@torch.library.custom_op("slime_sparse::gumbel_sample", mutates_args=())
def gumbel_sample(logits: Tensor, truncated: Tensor | None, streams: Tensor, temperature: float
                  ) -> tuple[Tensor, Tensor]:
    """(tokens [n] int64, log_softmax(logits / T)[token] [n] float32): argmax of (truncated, else logits / T) +
    gumbel_noise(streams); one opaque op for torch.compile and op counts."""
    return _KERNEL(logits, truncated, streams, temperature)


@gumbel_sample.register_fake
def _(logits: Tensor, truncated: Tensor | None, streams: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.int64), logits.new_empty(n, dtype=torch.float32)


def enabled(logits: Tensor) -> bool:
    return _KERNEL is not None and logits.device.type == "cuda"


def install(kernel) -> None:
    """Use `kernel` (a `build()`) for CUDA sampling from now on (`sampling.enable_kernel` checks it first)."""
    global _KERNEL
    _KERNEL = kernel
