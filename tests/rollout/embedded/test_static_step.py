"""The static decode step (#28): fixed shapes, no host synchronisation, the same tokens however it runs.

- compiled with torch.compile(fullgraph=True) it runs without a graph break (so without a host sync or a Python
  branch on a device value) and samples the tokens of the eager step;
- padding rows (a captured batch size larger than the running rows) and rows that ended unseen (tokens read back
  every k steps) are inert: the real rows' tokens, eviction records and KV stats are identical and their log-probs
  equal to float rounding (a matmul over 4 rows may round differently from one over 3: BLAS picks its kernel by
  shape, so only the tokens and what the cache held can be compared exactly across batch shapes);
- the CUDA-graph path is the same step replayed (tests/gpu/test_*.py checks it on a GPU).
"""
import pytest
import torch
from tests.helpers.engine_reference import masked_reference_logprobs, traced_engine
from transformers import Qwen2Config, Qwen2ForCausalLM

import slime_sparse.rollout.embedded.runner as runner_module
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.embedded.step import SPAN_GRANULARITY, decode_shapes


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [list(range(20, 50)), [5, 17, 3, 9, 40], [11, 2], [7, 7, 8, 1, 60, 61, 62, 3, 4], [9, 9, 9]]
RKV = KVCompressConfig(method="rkv", budget=12, buffer=4, window=3, kernel_size=3)
H2O = KVCompressConfig(method="h2o", budget=12, buffer=4, window=3)


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()


def assert_same_outputs(a, b):
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        assert x.finish_reason == y.finish_reason
        assert x.kv == y.kv
        assert (x.evictions is None) == (y.evictions is None)
        if x.evictions is not None:
            assert torch.equal(x.evictions.starts, y.evictions.starts)
            assert torch.equal(x.evictions.keep_bits, y.evictions.keep_bits)


def test_decode_shapes():
    assert decode_shapes("eager", 5) == ([1, 2, 3, 4, 5], 1)
    assert decode_shapes("cuda_graph", 64) == ([1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64], SPAN_GRANULARITY)
    assert decode_shapes("compile", 20) == ([1, 2, 4, 8, 16, 20], SPAN_GRANULARITY)
    assert decode_shapes("cuda_graph", 1) == ([1], SPAN_GRANULARITY)


@pytest.mark.parametrize("kv", [KVCompressConfig(), RKV, H2O], ids=lambda kv: kv.method)
def test_padding_rows_and_late_readback_are_inert(kv, monkeypatch):
    """Eager steps padded to captured batch sizes and spans, tokens read back every 5 steps and EOS in the middle of
    a window: the outputs of exact-size steps read every step."""
    model = make_model()
    stop = EmbeddedEngine(model).generate(PROMPTS[:1], SamplingParams(max_new_tokens=8, ignore_eos=True),
                                          seed=4)[0].response_ids[6]
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(stop,), ignore_eos=True)
    reference = EmbeddedEngine(model, kv, max_batch_size=4).generate(PROMPTS, params, seed=4)
    assert any(o.finish_reason == "stop" for o in reference) and any(o.finish_reason == "length" for o in reference)
    monkeypatch.setattr(runner_module, "decode_shapes", lambda mode, rows: decode_shapes("cuda_graph", rows))
    padded = EmbeddedEngine(model, kv, max_batch_size=4, readback_interval=5)
    assert_same_outputs(padded.generate(PROMPTS, params, seed=4), reference)
    # the rows that ended unseen kept running (and compressing) for a few steps: the forwards say so
    assert padded.last_stats.forwards >= EmbeddedEngine(model, kv, max_batch_size=4).last_stats.forwards


def test_late_readback_records_what_the_sampler_saw():
    """With the host reading tokens every 4 steps, the eviction record of every sample (compressions that ran after
    its end dropped) still reproduces its log-probs through the masked reference."""
    model = make_model()
    engine, records = traced_engine(model, RKV, max_batch_size=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True)
    traced = engine.generate(PROMPTS, params, seed=2)
    late = EmbeddedEngine(model, RKV, max_batch_size=3, readback_interval=4).generate(PROMPTS, params, seed=2)
    assert_same_outputs(late, traced)
    for i, out in enumerate(late):
        ref = masked_reference_logprobs(model, records[i], out.prompt_ids, out.response_ids, params.temperature)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)


def test_decode_step_compiles_fullgraph_and_samples_the_eager_tokens():
    """torch.compile(fullgraph=True) fails on any graph break: a host sync (.item(), .tolist()), a Python branch on
    a device value, an unsupported op. Compiled steps (padded to bucket sizes) draw the eager step's tokens."""
    model = make_model(1)
    prompts = [[5, 17, 3, 9, 40], [11, 2, 8, 1, 7], [1, 2, 3, 4, 5]]  # one admission, no row retires early
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    eager = EmbeddedEngine(model, RKV, max_batch_size=3).generate(prompts, params, seed=8)
    compiled = EmbeddedEngine(model, RKV, max_batch_size=3, step_mode="compile", readback_interval=4)
    torch._dynamo.reset()
    outs = compiled.generate(prompts, params, seed=8)
    for x, y in zip(outs, eager):
        assert x.response_ids == y.response_ids
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        assert x.kv == y.kv


def test_step_mode_is_checked():
    model = make_model()
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        EmbeddedEngine(model, step_mode="cuda_graph")
    with pytest.raises(ValueError, match="step_mode='fast'"):
        EmbeddedEngine(model, step_mode="fast")
    with pytest.raises(ValueError, match="readback_interval=0"):
        EmbeddedEngine(model, readback_interval=0)
