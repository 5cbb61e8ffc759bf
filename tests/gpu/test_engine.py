"""The embedded engine's decode step on a GPU (#28): CUDA graphs replay the eager step, exactly.

Skipped without CUDA (CI has none); `tools/gpu_checks.sh` runs them on the device machine. What they pin down:
- the decode step captured in CUDA graphs (one per padded batch size and span) samples the tokens of the eager
  step with the same log-probs, in fp32 and in bf16, dense and compressed, with rows ending early (stop ids) so
  that padding rows, late readback and row moves all happen;
- capture happens once per shape and the graphs are replayed (a graph per step would mean no speed-up);
- the sampler's log-probs equal the learner-side shadow recompute under the eviction record (fp32: to the
  tolerance of CUDA's kernels, whose reduction order differs between a one-token decode and a full forward).
"""
import pytest
import torch

import slime_sparse.rollout.embedded.runner as runner_module
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.embedded.step import decode_shapes
from tests.helpers.gpu import CUDA_ONLY, make_model, prompts

pytestmark = CUDA_ONLY



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv", [KVCompressConfig(), KVCompressConfig(method="rkv", budget=48, buffer=16, window=8),
                                KVCompressConfig(method="h2o", budget=48, buffer=16, window=8)], ids=lambda k: k.method)
def test_cuda_graph_step_equals_eager_step(dtype, kv, monkeypatch):
    """Eager steps at the graphs' padded shapes (rows and spans) against the replayed graphs: bit for bit."""
    monkeypatch.setattr(runner_module, "decode_shapes", lambda mode, rows: decode_shapes("cuda_graph", rows))
    model = make_model(dtype)
    batch = prompts(12)
    free = EmbeddedEngine(model, kv, device="cuda", step_mode="eager", max_batch_size=8).generate(
        batch, SamplingParams(max_new_tokens=16, ignore_eos=True), seed=3)
    stop = free[0].response_ids[10]
    params = SamplingParams(temperature=1.0, max_new_tokens=160, stop_token_ids=(stop,), ignore_eos=True)
    eager = EmbeddedEngine(model, kv, device="cuda", step_mode="eager", max_batch_size=8, readback_interval=8)
    graphs = EmbeddedEngine(model, kv, device="cuda", step_mode="cuda_graph", max_batch_size=8, readback_interval=8)
    a, b = eager.generate(batch, params, seed=3), graphs.generate(batch, params, seed=3)
    assert any(o.finish_reason == "stop" for o in a)
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids
        assert x.logprobs == y.logprobs  # the same kernels on the same shapes: bit for bit
        assert x.kv == y.kv
    if kv.enabled:
        assert graphs.last_stats.compressions > 0


def test_graphs_are_captured_once_per_shape_and_replayed_across_calls():
    model = make_model(torch.bfloat16)
    kv = KVCompressConfig(method="rkv", budget=48, buffer=16, window=8)
    engine = EmbeddedEngine(model, kv, device="cuda", max_batch_size=16)
    assert engine.step_mode == "cuda_graph"
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    engine.generate(prompts(16), params, seed=0)
    # one padded batch size (16 rows, all ending together) and one span (the cache never exceeds 64 slots): one decode
    # graph; compactions one per bucket of rows due together (prompts of different lengths reach the trigger apart)
    first = engine.last_stats.captures
    assert 2 <= first <= 1 + 5 and engine.captures == first and engine.last_stats.forwards >= 199
    assert engine.last_stats.compressions > 16
    engine.generate(prompts(16), params, seed=1)  # a second rollout: the runner and its graphs are reused
    assert engine.last_stats.captures == 0 and engine.captures == first
