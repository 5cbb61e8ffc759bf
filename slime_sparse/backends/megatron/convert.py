"""HF directory <-> Megatron distributed checkpoint, at a given TP / PP layout (the converters' logic).

Conversion is a host-memory job: the tools hide GPUs (CUDA_VISIBLE_DEVICES="") and run `tp * pp` local
processes over gloo, each building its own model stage and reading / writing only its shards. The
torch_dist checkpoint format reshards on load, so a checkpoint saved at one layout can be loaded by a
learner (or the reverse converter) at another.
"""
from __future__ import annotations

import argparse
import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
DTYPE_META_KEY = "params_dtype"  # in the checkpoint's meta: what the converter wrote, for the way back


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype={name!r} is invalid: choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def stored_dtype(hf_dir: str) -> str:
    """The --dtype name of the weights an HF directory stores (its first floating tensor's), so that a conversion
    keeps them as they are unless asked (an fp32 model stays fp32)."""
    from .hf_io import HFWeights

    weights = HFWeights(hf_dir)
    for name in weights:
        kind = weights.stored_dtype(name)
        if kind in _SAFETENSORS_DTYPES:
            return _SAFETENSORS_DTYPES[kind]
    raise ValueError(f"{hf_dir!r} stores no float32 / bfloat16 / float16 weights: pass --dtype")


def checkpoint_dtype(ckpt_dir: str) -> str:
    """The --dtype name of a Megatron checkpoint's weights: what the converter recorded, else the HF config's
    (the learner saves in the dtype it was built from), else float32."""
    from .checkpoint import read_meta

    meta = read_meta(ckpt_dir)
    hf_config = meta.get("hf_config", {})
    name = meta.get(DTYPE_META_KEY) or hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return name if name in DTYPES else "float32"


def _hf_to_megatron_worker(rank: int, world_size: int, hf_dir: str, out_dir: str, tp: int, pp: int, dtype: torch.dtype) -> None:
    from .checkpoint import save_model
    from .hf_io import HFWeights, load_hf_weights
    from .model_config import ModelSpec, build_gpt_model, read_hf_config
    from .parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig(tp, pp))
    hf_config = read_hf_config(hf_dir)
    spec = ModelSpec.from_hf_config(hf_config)
    model = build_gpt_model(spec, params_dtype=dtype)
    load_hf_weights(model, spec, HFWeights(hf_dir))
    name = next(k for k, v in DTYPES.items() if v == dtype)
    save_model(model, out_dir, hf_config=hf_config, hf_dir=hf_dir, extra_meta={DTYPE_META_KEY: name})


def _megatron_to_hf_worker(rank: int, world_size: int, ckpt_dir: str, out_dir: str, tp: int, pp: int, dtype: torch.dtype) -> None:
    from .checkpoint import HF_EXTRA_DIR, copy_hf_side_files, load_model, read_meta
    from .hf_io import export_hf_weights, save_hf_checkpoint
    from .model_config import ModelSpec, build_gpt_model
    from .parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig(tp, pp))
    hf_config = read_meta(ckpt_dir)["hf_config"]
    spec = ModelSpec.from_hf_config(hf_config)
    model = build_gpt_model(spec, params_dtype=dtype)
    load_model(model, ckpt_dir)
    weights = export_hf_weights(model, spec)  # collective: every rank iterates it
    if rank == 0:
        name = next(k for k, v in DTYPES.items() if v == dtype)
        key = "dtype" if "dtype" in hf_config else "torch_dtype"  # transformers 5 writes `dtype`
        save_hf_checkpoint(weights, out_dir, {**hf_config, key: name})
        copy_hf_side_files(os.path.join(ckpt_dir, HF_EXTRA_DIR), out_dir)
    else:
        for _ in weights:
            pass


def _check_layout(tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp and --pp must be >= 1, got tp={tp} pp={pp}")


def hf_to_megatron(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, dtype: str | None = None) -> str:
    """Convert an HF Qwen2/Llama directory into a Megatron distributed checkpoint saved at TP x PP, in `dtype`
    (None: the dtype the HF weights are stored in); returns the dtype written."""
    from .model_config import ModelSpec, transformer_config
    from .parallel import spawn

    _check_layout(tp, pp)
    transformer_config(ModelSpec.from_hf_dir(hf_dir), tp_size=tp, pp_size=pp)  # validates the layout early
    dtype = dtype or stored_dtype(hf_dir)
    spawn(_hf_to_megatron_worker, tp * pp, hf_dir, out_dir, tp, pp, parse_dtype(dtype))
    return dtype


def megatron_to_hf(ckpt_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, dtype: str | None = None) -> str:
    """Convert a Megatron distributed checkpoint (any saved layout) into an HF directory, loading it at TP x PP, in
    `dtype` (None: the checkpoint's, `checkpoint_dtype`); returns the dtype written."""
    from .parallel import spawn

    _check_layout(tp, pp)
    dtype = dtype or checkpoint_dtype(ckpt_dir)  # also a clear error before starting processes
    spawn(_megatron_to_hf_worker, tp * pp, ckpt_dir, out_dir, tp, pp, parse_dtype(dtype))
    return dtype


def converter_parser(description: str, source: str, source_help: str, layout_role: str,
                     dtype_help: str) -> argparse.ArgumentParser:
    """The converters' shared command line: `source` directory, --out-dir, --tp / --pp (`layout_role`: what the
    layout is for) and --dtype."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(source, required=True, help=source_help)
    parser.add_argument("--out-dir", required=True, help="where to write the result")
    parser.add_argument("--tp", type=int, default=1, help=f"tensor-model-parallel size {layout_role}")
    parser.add_argument("--pp", type=int, default=1, help=f"pipeline-model-parallel size {layout_role}")
    parser.add_argument("--dtype", default=None, help=f"{dtype_help}: float32, bfloat16 or float16 (default: the "
                        "source's, so an fp32 model stays fp32)")
    return parser


def hide_gpus() -> None:
    """Conversion runs on CPU over gloo; call before torch initialises CUDA."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
