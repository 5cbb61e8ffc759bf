"""Which optional GPU kernels the Megatron learner uses: each one only where it imports, decided once per process.

megatron-core 0.16.1 turns a fusion flag of TransformerConfig into an import of a kernel module, often only at the
first forward (so a missing one crashes a run after minutes of start-up, not at construction). A stock GPU node
(PyTorch + Triton, no Apex, no Transformer Engine) has some of them and not others. The module each flag needs,
read from megatron-core 0.16.1:

- masked_softmax_fusion: Apex's `scaled_upper_triang_masked_softmax_cuda` (the causal path) and
  `scaled_masked_softmax_cuda` (its shape check), imported inside fusions/fused_softmax.py's forward;
- bias_activation_fusion, bias_dropout_fusion: torch.compile (megatron.core.jit's jit_fuser), so Triton on a GPU
  (fusions/fused_bias_swiglu.py, fused_bias_dropout.py);
- apply_rope_fusion: Transformer Engine >= 1.4 (`rope_utils.fused_apply_rotary_pos_emb`, checked in
  TransformerConfig.__post_init__);
- gradient_accumulation_fusion: Apex's `fused_weight_gradient_mlp_cuda`, also with TE (the output layer and the
  embedding stay Megatron's ColumnParallelLinear, which refuses the flag without it; tensor_parallel/layers.py);

and Transformer Engine's layer spec when `transformer_engine` imports (with a GPU), megatron-core's local spec
otherwise. On CPU every fusion is off (the kernels are CUDA-only; torch.compile on CPU would need a C++ toolchain
for no gain in tests). None of them changes the arithmetic the learner is checked against beyond float rounding:
the fused softmax also computes in fp32, and the fused bias/activation ops are the unfused ones compiled.
"""
from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger(__name__)

MASKED_SOFTMAX_MODULES = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda")
GRAD_ACCUM_MODULE = "fused_weight_gradient_mlp_cuda"


@dataclass(frozen=True)
class KernelChoice:
    """Optional kernels of this process (field names: TransformerConfig's flags, plus the layer spec)."""

    transformer_engine: bool = False  # TE layer spec; else megatron-core's local spec
    masked_softmax_fusion: bool = False
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False
    gradient_accumulation_fusion: bool = False

    def fusion_flags(self) -> dict[str, bool]:
        """The TransformerConfig keyword arguments."""
        flags = asdict(self)
        flags.pop("transformer_engine")
        return flags

    def describe(self) -> str:
        spec = "Transformer Engine layer spec" if self.transformer_engine else "local layer spec (no TE)"
        on = [k for k, v in self.fusion_flags().items() if v]
        off = [k for k, v in self.fusion_flags().items() if not v]
        return f"{spec}; fusions on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # ImportError, or a CUDA extension built for another torch / driver (OSError, RuntimeError)
        return False
    return True


def _te_rope_fusion() -> bool:
    """What TransformerConfig.__post_init__ checks for apply_rope_fusion (set at megatron import when TE loads)."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None


def probe_kernels(on_gpu: bool) -> KernelChoice:
    """The kernels this process can run, by importing each as megatron-core would (no logging, no caching)."""
    if not on_gpu:
        return KernelChoice()
    compiled = _imports("triton")  # megatron.core.jit's jit_fuser is torch.compile: Inductor needs Triton on CUDA
    return KernelChoice(
        transformer_engine=_imports("transformer_engine"),
        masked_softmax_fusion=all(_imports(m) for m in MASKED_SOFTMAX_MODULES),
        bias_activation_fusion=compiled,
        bias_dropout_fusion=compiled,
        apply_rope_fusion=_te_rope_fusion(),
        gradient_accumulation_fusion=_imports(GRAD_ACCUM_MODULE),
    )


@functools.lru_cache(maxsize=None)
def kernel_choice() -> KernelChoice:
    """This process's choice (probed once, logged once)."""
    on_gpu = torch.cuda.is_available()
    choice = probe_kernels(on_gpu)
    why = "each fusion on only where its kernel imports" if on_gpu else "CPU: the fusions are CUDA kernels"
    logger.info("Megatron learner kernels (%s): %s", why, choice.describe())
    return choice
