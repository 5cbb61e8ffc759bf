"""The Megatron learner on a stock GPU node: each fusion on only where its kernel imports (megatron/kernels.py).

The first GPU run (H200, no Apex, no Transformer Engine) crashed at its first forward with
`No module named 'scaled_masked_softmax_cuda'` because masked_softmax_fusion was on whenever CUDA was. These tests
hide (or fake) the kernel modules megatron-core imports and check the TransformerConfig that results; the probe is
told it runs on a GPU, so they run on CPU.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest

pytest.importorskip("megatron.core")
from megatron.core.models.common.embeddings import rope_utils  # noqa: E402

from slime_sparse.backends.megatron import kernels  # noqa: E402
from slime_sparse.backends.megatron.kernels import (  # noqa: E402
    GRAD_ACCUM_MODULE, MASKED_SOFTMAX_MODULES, KernelChoice, kernel_choice, probe_kernels,
)
from slime_sparse.backends.megatron.model_config import ModelSpec, transformer_config  # noqa: E402

pytestmark = pytest.mark.megatron

FUSIONS = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion")
KERNEL_MODULES = (*MASKED_SOFTMAX_MODULES, GRAD_ACCUM_MODULE, "transformer_engine", "triton")
SPEC = ModelSpec.from_hf_config({
    "model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
})


def _hide(monkeypatch, names) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError


def _fake(monkeypatch, names) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))


def test_stock_gpu_node_runs_with_every_fusion_off(monkeypatch):
    """PyTorch without Triton, Apex or TE: nothing optional imports, so nothing optional is used."""
    _hide(monkeypatch, KERNEL_MODULES)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    choice = probe_kernels(on_gpu=True)
    assert choice == KernelChoice()
    config = transformer_config(SPEC, kernels=choice)
    assert {name: getattr(config, name) for name in FUSIONS} == dict.fromkeys(FUSIONS, False)


def test_the_device_image_gets_the_compiled_fusions_only(monkeypatch):
    """The GPU image of the first measurements: Triton (torch.compile) but no Apex and no TE."""
    _hide(monkeypatch, (*MASKED_SOFTMAX_MODULES, GRAD_ACCUM_MODULE, "transformer_engine"))
    _fake(monkeypatch, ["triton"])
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    choice = probe_kernels(on_gpu=True)
    assert choice == KernelChoice(bias_activation_fusion=True, bias_dropout_fusion=True)
    config = transformer_config(SPEC, kernels=choice)
    assert not config.masked_softmax_fusion and not config.gradient_accumulation_fusion
    assert config.bias_activation_fusion and config.bias_dropout_fusion


def test_every_kernel_importable_turns_every_fusion_on(monkeypatch):
    _fake(monkeypatch, KERNEL_MODULES)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *args, **kwargs: None)
    choice = probe_kernels(on_gpu=True)
    assert all(dataclasses.asdict(choice).values()), choice
    config = transformer_config(SPEC, kernels=choice)  # megatron-core's own checks (rope fusion needs TE) pass
    assert all(getattr(config, name) for name in FUSIONS)


def test_masked_softmax_needs_both_apex_kernels(monkeypatch):
    """The causal path imports scaled_upper_triang_masked_softmax_cuda, its shape check scaled_masked_softmax_cuda."""
    _fake(monkeypatch, [MASKED_SOFTMAX_MODULES[0]])
    _hide(monkeypatch, [MASKED_SOFTMAX_MODULES[1]])
    assert not probe_kernels(on_gpu=True).masked_softmax_fusion


def test_cpu_uses_no_fusion_even_when_kernels_import(monkeypatch):
    _fake(monkeypatch, KERNEL_MODULES)
    assert probe_kernels(on_gpu=False) == KernelChoice()


def test_the_choice_is_logged_once_per_process(monkeypatch, caplog):
    kernel_choice.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=kernels.__name__):
            first, second = kernel_choice(), kernel_choice()
        assert first is second
        records = [r for r in caplog.records if r.name == kernels.__name__]
        assert len(records) == 1 and "layer spec" in records[0].getMessage()
    finally:
        kernel_choice.cache_clear()
