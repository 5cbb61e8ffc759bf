"""What the GPU tests share: their marks (marker `gpu`, skipped without CUDA; tools/gpu_checks.sh runs them on the
device machine) and the small random Qwen2 and prompts the engine's GPU tests decode."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

CUDA_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=1024)


def make_model(dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to("cuda", dtype).eval()


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 2048, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
