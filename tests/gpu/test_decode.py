"""The decode step at hardware speed (#43 item 3) on a GPU (marker `gpu`; skipped without CUDA, `tools/gpu_checks.sh`
runs it): every way of running the step samples the same tokens.

- step modes (eager, cuda_graph, cuda_graph_compile = inductor inside our graphs) x attention (sdpa, the length-reading
  Triton kernel) x body (ours, HF's modules), fp32: the tokens of eager + sdpa + HF's modules, log-probs to 1e-5,
  dense and R-KV; the timed path captures nothing once warm;
- the engine on CUDA chose the Triton attention and the one-kernel sampler by default (their self-checks passed);
- bf16: the body, the kernel and the compiled step stay within bf16 rounding of HF's decode (tokens may part at
  near-ties, so log-probs are compared where the tokens agree).
"""
import pytest
import torch

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout import SamplingParams, sampling_kernel
from slime_sparse.rollout.embedded import EmbeddedEngine
from tests.helpers.gpu import CUDA_ONLY, make_model, prompts

pytestmark = CUDA_ONLY

PARAMS = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=96, ignore_eos=True)
VARIANTS = [("cuda_graph", "sdpa", False), ("cuda_graph", "triton", False), ("eager", "triton", False),
            ("cuda_graph_compile", "triton", False), ("cuda_graph", "sdpa", True)]  # (mode, attention, HF modules)


def engine(model, kv, mode, attention, hf):
    return EmbeddedEngine(model, kv, device="cuda", step_mode=mode, decode_attention=attention, hf_decode=hf,
                          max_batch_size=8)


def test_defaults_on_cuda_are_the_kernels():
    eng = EmbeddedEngine(make_model(torch.float32), device="cuda")
    eng.generate(prompts(2), SamplingParams(max_new_tokens=4), seed=0)
    assert eng.decode_attention == "triton" and eng.decode_body_reason is None
    assert sampling_kernel._KERNEL is not None


@pytest.mark.parametrize("kv", [KVCompressConfig(), KVCompressConfig(method="rkv", budget=48, buffer=16, window=8)],
                         ids=lambda k: k.method)
def test_every_way_of_running_the_step_samples_the_same_tokens_fp32(kv):
    model, batch = make_model(torch.float32), prompts(12)
    reference = engine(model, kv, "eager", "sdpa", True).generate(batch, PARAMS, seed=3)
    for mode, attention, hf in VARIANTS:
        eng = engine(model, kv, mode, attention, hf)
        eng.generate(batch, PARAMS, seed=2)  # warm: graphs captured, kernels compiled
        outs = eng.generate(batch, PARAMS, seed=3)
        assert eng.last_stats.captures == 0, (mode, attention, hf)
        for x, y in zip(outs, reference):
            assert x.response_ids == y.response_ids, (mode, attention, hf)
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
            assert x.kv == y.kv


def test_bf16_stays_within_rounding_of_hf_decode():
    model, batch = make_model(torch.bfloat16), prompts(12)
    reference = engine(model, KVCompressConfig(), "eager", "sdpa", True).generate(batch, PARAMS, seed=3)
    for mode, attention, hf in VARIANTS[:-1]:
        outs = engine(model, KVCompressConfig(), mode, attention, hf).generate(batch, PARAMS, seed=3)
        diffs = []
        for x, y in zip(outs, reference):  # up to the first token where the two part (then the contexts differ)
            common = next((i for i, (s, t) in enumerate(zip(x.response_ids, y.response_ids)) if s != t), 96)
            diffs += [abs(a - b) for a, b in zip(x.logprobs[: common + 1], y.logprobs[: common + 1])]
        agree = sum(x.response_ids[:8] == y.response_ids[:8] for x, y in zip(outs, reference))
        assert agree >= 10 and sum(diffs) / len(diffs) < 0.02, (mode, attention, agree, sum(diffs) / len(diffs))
