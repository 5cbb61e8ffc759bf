"""A local Hugging Face model directory (--hf-checkpoint) as the learner and the rollout engine read it: the one
place that loads its weights, its tokenizer, and its EOS id. Only local directories: never a hub id."""
from __future__ import annotations

import os

import torch
from torch import nn

# files of a tokenizer saved by save_pretrained (one of them is enough for AutoTokenizer)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def load_model(model_or_path: nn.Module | str | os.PathLike, device: torch.device | str,
               dtype: torch.dtype | None = None) -> nn.Module:
    """A causal LM on `device`, in eval mode: read from a local directory (in `dtype`, fp32 when None), or a
    module already built, moved there (and cast to `dtype` when given)."""
    if isinstance(model_or_path, (str, os.PathLike)):
        if not os.path.isdir(model_or_path):
            raise ValueError(f"model path {os.fspath(model_or_path)!r} is not a local directory (--hf-checkpoint)")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=dtype or torch.float32)
    else:
        model = model_or_path
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device=device)
    return model.eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenizer_eos_id(model_dir: str) -> int | None:
    """EOS id of the tokenizer in `model_dir`; None when the directory holds no tokenizer (a run cannot start
    there anyway: it loads the same tokenizer first)."""
    if not model_dir or not any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        return None
    eos = load_tokenizer(model_dir).eos_token_id
    return None if eos is None else int(eos)
