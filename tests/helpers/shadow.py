"""What the shadow-forward tests share: a tiny random Qwen2, prompts (prompt 0 longer than budget + buffer, so it is
prefilled in chunks with compressions in between), and their one check: the learner's shadow forward of each
sample's eviction record reproduces the log-probs the sampler recorded under the compressed cache."""
from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.backends.logprobs import response_logprobs

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [list(range(20, 50)), [5, 17, 3, 9, 40], [11, 2], [7, 7, 8, 1, 60, 61, 62, 3, 4]]


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()


def shadow_error(model, outs, temperature: float = 0.9) -> float:
    """max |shadow forward - sampler| over every response token of `outs` (0.9: the temperature the tests sample at)."""
    tokens = [o.prompt_ids + o.response_ids for o in outs]
    lens = [len(o.response_ids) for o in outs]
    sampler = torch.nn.utils.rnn.pad_sequence([torch.tensor(o.logprobs) for o in outs], batch_first=True)
    with torch.no_grad():
        shadow, _ = response_logprobs(model, tokens, lens, temperature=temperature, shadow=[o.evictions for o in outs])
    return float((shadow - sampler).abs().max())
