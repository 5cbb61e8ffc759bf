"""Hugging Face config (Qwen2 / Qwen2.5 / Llama) -> megatron-core TransformerConfig and GPTModel.

`ModelSpec` holds the architecture facts both sides agree on, read from an HF `config.json` dict (so
it works with any transformers version and without transformers at all). `build_gpt_model` builds the
GPTModel stage of the calling rank (tensor / pipeline parallel state must be initialised first).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from slime_sparse.utils.lm_head import lm_head_logits

from .kernels import KernelChoice, kernel_choice

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
# Megatron's llama3 RoPE scaling hard-codes these (rotary_pos_embedding._apply_scaling).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a Qwen2/Llama decoder: pre-RMSNorm, RoPE, GQA attention, SwiGLU MLP."""

    model_type: str  # "qwen2" or "llama"
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: True; Llama: `attention_bias` (False for released models)
    rope_scaling_factor: float | None = None  # llama3-style scaling, None = plain RoPE

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelSpec":
        """Read an HF config dict; ValueError names the field we cannot represent."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act={cfg['hidden_act']!r}: only SwiGLU ('silu') MLPs are supported")
        if model_type == "qwen2" and cfg.get("use_sliding_window", False):
            raise ValueError("config.json use_sliding_window=true: sliding-window attention is not supported")
        if model_type == "llama" and cfg.get("mlp_bias", False):
            raise ValueError("config.json mlp_bias=true is not supported (Megatron's add_bias_linear also adds an o_proj bias)")
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        theta, factor = _rope_settings(cfg)
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            rope_scaling_factor=factor,
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelSpec":
        return cls.from_hf_config(read_hf_config(path))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_hf_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path!r} is not a Hugging Face model directory (no config.json)")
    with open(cfg_path, encoding="utf-8") as f:
        return json.load(f)


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None) from either transformers>=5 `rope_parameters` or the
    older `rope_theta` + `rope_scaling` fields."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "llama3":
        for key, expected in _MEGATRON_LLAMA3_ROPE.items():
            if key in params and float(params[key]) != expected:
                raise ValueError(f"config.json rope {key}={params[key]}: megatron-core's llama3 RoPE scaling fixes it to {expected}")
        return theta, float(params.get("factor", 8.0))
    raise ValueError(f"config.json rope_type={rope_type!r} is not supported (only default and llama3)")


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's padding: the vocabulary is split evenly over TP ranks in multiples of `divisible_by`.
    Padded rows are zeros and their logits are masked out of every softmax we compute."""
    multiple = divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(
    spec: ModelSpec,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute=None,
    kernels: KernelChoice | None = None,
):
    """The TransformerConfig that reproduces the HF forward. Dropout is 0 (RL fine-tuning recomputes
    log-probs that must match the sampler's); each fusion is on only where its kernel imports (`kernels`,
    default: this process's `kernel_choice()`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if spec.num_kv_heads % tp_size:
        raise ValueError(f"--tensor-model-parallel-size={tp_size} must divide num_key_value_heads={spec.num_kv_heads}")
    if spec.num_layers % pp_size:
        raise ValueError(f"--pipeline-model-parallel-size={pp_size} must divide num_hidden_layers={spec.num_layers}")
    kernels = kernel_choice() if kernels is None else kernels
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        **kernels.fusion_flags(),
        persist_layer_norm=False,  # Apex's persistent LayerNorm kernel: our models use RMSNorm
        **(recompute.megatron_kwargs() if recompute is not None else {}),  # backends.recompute.Recompute
    )
    # Micro-batches are padded to their own longest row, so pipeline stages exchange shapes first. Set after
    # __post_init__, whose check against MoE's allgather dispatcher (its default) does not apply to dense models.
    config.variable_seq_lengths = True
    return config


def layer_spec(spec: ModelSpec, use_te: bool | None = None):
    """Transformer Engine spec when TE is importable on a GPU (`kernel_choice()`), megatron-core's local spec
    otherwise; `use_te` (--megatron's use_te) overrides."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = kernel_choice().transformer_engine if use_te is None else use_te
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def build_gpt_model(
    spec: ModelSpec,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    sequence_parallel: bool = False,
    vocab_divisible_by: int = 128,
    recompute=None,
    fp32_lm_head: bool = False,
):
    """Build this rank's GPTModel stage (parallel state initialised; CPU shim applied when no CUDA).
    `fp32_lm_head`: the output layer computes its logits in fp32 (`fp32_output_layer`).

    Weights are randomly initialised even when they are loaded right after: megatron-core only marks
    parameters as tensor-parallel (`tensor_model_parallel`, read by grad-norm clipping and the
    optimizer) inside its init path."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from .cpu_shim import apply_cpu_shim

    apply_cpu_shim()
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    config = transformer_config(
        spec,
        tp_size=tp,
        pp_size=pp,
        params_dtype=params_dtype,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, use_te),
        vocab_size=padded_vocab_size(spec.vocab_size, tp, vocab_divisible_by),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,  # logits stay vocab-sharded; log-probs use the vocab-parallel cross entropy
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
    )
    if fp32_lm_head and model.post_process:
        fp32_output_layer(model.output_layer)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model


def fp32_output_layer(output_layer) -> None:
    """Run Megatron's vocab-parallel output layer through `utils.lm_head.lm_head_logits(fp32=True)`: fp32 copies
    of the hidden states and of this rank's weight shard go through the layer's own linear (TP communication
    included), so the logits are the sampler's fp32 head. Gradient-accumulation fusion is off for this layer: it
    writes into `weight.main_grad`, which the fp32 copy does not have (the gradient reaches the bf16 parameter
    through the cast, and Megatron's DDP hook from there)."""
    project = output_layer._forward_impl

    def forward_impl(input, weight, *args, **kwargs):
        kwargs["gradient_accumulation_fusion"] = False
        return lm_head_logits(input, weight, fp32=True, linear=lambda h, w: project(h, w, *args, **kwargs))

    output_layer._forward_impl = forward_impl
