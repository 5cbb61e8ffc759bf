"""Next-token logits and log-probs: the one formula the sampler and the learners share.

Sparse-RL's xi = pi_old / pi_sparse must measure the sparse cache, not two ways of rounding the same numbers.
In bf16 the largest avoidable gap is the LM head: its output rounded to bf16 has a spacing of 0.06-0.125 for
logits of magnitude 8-32, and two forwards whose hidden states differ in the last bit round to different grid
points (MiniMax-M1 found the head to be the main source of training/inference mismatch; ScaleRL adopts the fix).
So every engine and learner of this project computes

    logits = hidden_states @ W_head^T          (in fp32 with `fp32=True`, else in the model dtype, then fp32)
    logp   = log_softmax(logits / T)           (always fp32; T = 0, greedy: untempered)

through `lm_head_logits` and `tempered_log_softmax` below; top-k / top-p truncation only decides which tokens
may be drawn and never enters the recorded log-prob (slime's and SGLang's convention), so the learner applies no
truncation either.

The flag is SGLang's `--enable-fp32-lm-head` (the same arithmetic: both operands cast to fp32, an fp32 GEMM;
TRL: `cast_lm_head_to_fp32`, vLLM: `hf_overrides={"head_dtype": "float32"}`). Off by default, as in each of them
and in slime (whose Megatron learner casts bf16 logits to fp32 before the log-softmax, exactly our `fp32=False`).
Both functions are free of host syncs and data-dependent Python (`fp32` and `temperature` are Python constants
of a run), so an engine can call them inside a CUDA graph or under torch.compile(fullgraph=True).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

FP32_LM_HEAD_HELP = (
    "compute the LM head (the final projection to vocabulary logits) in fp32 on every engine and learner, and pass "
    "--enable-fp32-lm-head to the SGLang servers (SGLang's flag and arithmetic: both operands cast to fp32; TRL: "
    "cast_lm_head_to_fp32). The log-softmax is always fp32. Off by default, as in SGLang, slime, verl and TRL: a "
    "bf16 run then rounds its logits to bf16 on both sides. On, the bf16 numeric sampler/learner mismatch "
    "shrinks (SmolLM2-135M, CPU: dense control mean |dlogp| 0.040 -> 0.026, k3 1.7e-3 -> 8.0e-4; "
    "benchmarks/numeric_mismatch.py). Cost in bf16: an fp32 copy of the head weight (vocab x hidden x 4 bytes: "
    "2.0 GiB for Qwen2.5-7B, divided by TP) held from forward to backward and an fp32 weight gradient of that size "
    "during backward (measured: +0.13 GiB peak for a SmolLM2 step of 8 x 256 tokens), fp32 GEMMs for the head; the "
    "Megatron learner also holds fp32 instead of bf16 logits for every position (+2 bytes x tokens x vocab / TP). "
    "Nothing changes in an fp32 run"
)


def lm_head_logits(hidden: Tensor, weight: Tensor, *, fp32: bool, linear=F.linear) -> Tensor:
    """float32 next-token logits [..., V] from final (normed) hidden states [..., H] and the head weight [V, H].

    `fp32=True`: the GEMM runs on fp32 copies of both operands (bf16 values are exact in fp32, so only the output
    rounding differs from a bf16 GEMM with fp32 accumulation); differentiable, gradients flow back to the weight's
    own dtype (a tied embedding stays one parameter). `fp32=False`: the GEMM in the operands' dtype, then cast.
    `linear(x, w)`: the projection; Megatron's learner passes its vocab-parallel linear (TP communication)."""
    if fp32:
        return linear(hidden.float(), weight.float())
    return linear(hidden, weight).float()


def hf_head_weight(model: torch.nn.Module) -> Tensor:
    """The LM head weight [V, H] of a transformers causal LM whose logits are `lm_head(final hidden states)` and
    nothing more (Qwen2 / Llama); ValueError for a head with a bias or a model that scales / caps its logits."""
    cfg = model.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, name, None) not in (None, 1.0):
            raise ValueError(f"{cfg.model_type}: config {name}={getattr(cfg, name)} changes the logits after the LM "
                             "head, which lm_head_logits does not reproduce")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{cfg.model_type}: an LM head with a bias is not supported")
    return head.weight


def tempered_log_softmax(logits: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / T) in float32 over the last dim; T = 0 (greedy) leaves the logits untempered."""
    logits = logits.float()
    if temperature > 0.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)
