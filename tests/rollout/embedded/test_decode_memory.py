"""The decode step's working set as admission counts it (kv/engine_memory.py) against what the step allocates, term by
term, on the meta device (the allocations of CPU code, shapes only; `utils.mem_audit.LiveBytes`): the sampler
(`Sampler.bytes_per_logit`: the torch path and the one-kernel path, each with the logits held by the caller or handed
over) and the body's forward (ours, `decode_body_bytes`, and HF's, `body_bytes`). The whole generate() is checked
in tests/rollout/embedded/test_engine_memory.py."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.kv import KVCompressConfig, layer_budgets
from slime_sparse.kv.engine_memory import Sampler, body_bytes, decode_body_bytes, sampler_bytes
from slime_sparse.utils.model_shape import ModelShape
from slime_sparse.rollout.embedded.attention import budget_attention_installed
from slime_sparse.rollout.embedded.cache import DecodeView
from slime_sparse.rollout.embedded.decode_body import DecodeBody
from slime_sparse.rollout.embedded.runner import ModelRunner, RunnerShape
from slime_sparse.rollout.sampling import SamplingParams, sample_tokens
from slime_sparse.utils.mem_audit import LiveBytes

META = torch.device("meta")
PARAMS = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
          [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.7, 20, 1.0), (1.0, 20, 1.0), (1.0, -1, 0.9), (0.7, -1, 0.9),
           (0.7, 20, 0.9), (0.0, -1, 1.0)]]


def fake_kernel(logits, truncated, streams, temperature):
    """What `sampling_kernel`'s launch allocates: a token and a log-prob per row."""
    return logits.new_empty(logits.shape[0], dtype=torch.int64), logits.new_empty(logits.shape[0])


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "kernel"])
def test_the_sampler_allocates_what_is_counted(params, fused):
    rows, vocab = 64, 4096
    shape = ModelShape(1, 8, 1, 1, 8, 8, vocab, False, False)
    keys, counters = torch.arange(rows, device=META), torch.arange(rows, device=META)
    kernel = fake_kernel if fused else None
    with torch.inference_mode(), LiveBytes() as owned:  # the decode step hands its logits over
        sample_tokens(torch.empty(rows, vocab, device=META), params, keys, counters, kernel=kernel)
    held = torch.empty(rows, vocab, device=META)  # a prefill's first tokens: the caller keeps them
    with torch.inference_mode(), LiveBytes() as beside:
        sample_tokens(held, params, keys, counters, kernel=kernel)
    sampler = Sampler.of(params, fused)
    for measured, owns in ((owned.peak, True), (beside.peak, False)):
        counted = sampler_bytes(shape, rows, sampler, owns_logits=owns)
        assert counted == pytest.approx(measured, rel=0.01, abs=2048), (owns, counted, measured)


SHAPES = {"tiny": dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2),
          "1.5B-wide": dict(vocab_size=64, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2,
                            num_attention_heads=12, num_key_value_heads=2)}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["none", "rkv", "h2o", "pyramidkv"])
def test_a_decode_forward_allocates_what_is_counted(name, dtype, method):
    """Our body's forward and HF's (the hf_decode path), under SDPA, to 2 %."""
    kv = KVCompressConfig(method=method, budget=96, buffer=32, window=8) if method != "none" else KVCompressConfig()
    config = Qwen2Config(**SHAPES[name], max_position_embeddings=512)
    model = Qwen2ForCausalLM(config).to(dtype).to(META)
    layers = config.num_hidden_layers
    budgets = layer_budgets(kv, layers) if kv.enabled else (kv.budget,) * layers
    rows, capacity = 8, max(budgets) + kv.buffer if kv.enabled else 128
    shape = ModelShape.from_hf_config(config.to_dict())
    for body in (DecodeBody(model), None):
        runner = ModelRunner(model, RunnerShape(kv, rows, capacity, "eager", 1), budgets, META, lambda h: h, body)
        st, spans = runner.state, (capacity,) * layers
        with torch.inference_mode(), budget_attention_installed(model):
            runner.cache.begin(DecodeView(rows, spans, st.positions[:rows]))
            with LiveBytes() as t:
                if body is not None:
                    body(st.tokens[:rows], st.positions[:rows], runner.cache)
                else:
                    runner.step.forward(st.tokens[:rows, None], st.positions[:rows, None])
            runner.cache.end_decode()
        counted = decode_body_bytes(shape, kv, rows, capacity, dtype.itemsize) if body is not None \
            else body_bytes(shape, kv, rows, 1, capacity, dtype.itemsize)
        assert counted == pytest.approx(t.peak, rel=0.02), ("ours" if body is not None else "hf", counted, t.peak)


def test_admission_splits_the_span_as_the_triton_decode_attention_does():
    """The Triton kernel's partial outputs are counted per split (`decode_attention_bytes`): the same split count."""
    from slime_sparse.kv.engine_memory import decode_splits
    from slime_sparse.rollout.embedded import triton_attention

    assert all(triton_attention.num_splits(span) == decode_splits(span) for span in range(1, 6000, 7))
