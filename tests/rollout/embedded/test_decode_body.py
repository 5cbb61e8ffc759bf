"""Our decode body (#43 item 3, `rollout/embedded/decode_body.py`): HF's forward, fewer kernels, fused weights that
follow every weight update.

- equal to the model's own forward (fp32, 1e-5) for Qwen2 (q/k/v biases), Llama, Llama with attention and MLP biases
  and a head dim of its own, multi-head attention; in bf16 within bf16 rounding of HF's decode;
- the engine through it equals the engine through HF's modules (tokens, log-probs, eviction records) for dense and
  compressed caches;
- the fused q/k/v and gate/up weights are the HF parameters (views): state_dict names and shapes unchanged,
  update_weights / sync and tied heads work, a conversion that replaces the data is noticed and fused again;
- architectures it does not know decode through HF's modules, with the reason;
- the step through it is capture-safe (meta device) and dispatches at most half the operations of HF's per step.
"""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.embedded.attention import budget_attention_installed
from slime_sparse.rollout.embedded.contract import decode_body_error
from slime_sparse.rollout.embedded.decode_body import DecodeBody, build, unsupported
from slime_sparse.rollout.embedded.runner import ModelRunner, RunnerShape
from slime_sparse.utils.lm_head import hf_head_weight, lm_head_logits
from slime_sparse.utils.op_audit import CaptureGuard, OpCounter

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
PROMPTS = [[5, 17, 3, 9, 40], [11, 2], [7, 7, 8, 1, 60, 61, 62, 3, 4], [9, 9, 9]]
SAMPLE = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)


def qwen2(seed=0, **over):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, **over})).eval()


def llama(seed=0, **over):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**SHAPE, **over})).eval()


def perturbed(model):
    """Random non-zero biases (HF initialises them to 0, which would hide a bias left out)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


MODELS = {
    "qwen2": lambda: perturbed(qwen2()),
    "llama": lambda: llama(),
    "llama-biases-head-dim": lambda: perturbed(llama(attention_bias=True, mlp_bias=True, head_dim=24)),
    "qwen2-mha-tied": lambda: perturbed(qwen2(num_key_value_heads=4, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_body_equals_the_models_forward_fp32(name):
    assert decode_body_error(MODELS[name]()) <= 1e-5


def test_body_in_bf16_rounds_as_hf_decodes():
    """In bf16 the body's norm and RoPE round where HF's do; what is left is the GEMMs' own rounding (a fused qkv GEMM
    may sum in another order): within a few bf16 ulps of HF's decode, far below the model's numeric mismatch."""
    model = perturbed(qwen2()).to(torch.bfloat16)
    reference = EmbeddedEngine(copy.deepcopy(model), hf_decode=True).generate(PROMPTS, SAMPLE, seed=3)
    ours = EmbeddedEngine(model).generate(PROMPTS, SAMPLE, seed=3)
    diffs = [abs(a - b) for x, y in zip(ours, reference) for a, b in zip(x.logprobs, y.logprobs)]
    assert [x.response_ids for x in ours] == [y.response_ids for y in reference]
    assert max(diffs) < 0.02 and sum(diffs) / len(diffs) < 1e-3, max(diffs)  # measured on CPU: 0 (bit-identical)


@pytest.mark.parametrize("kv", [KVCompressConfig(), KVCompressConfig(method="rkv", budget=12, buffer=4, window=3),
                                KVCompressConfig(method="h2o", budget=12, buffer=4, window=3),
                                KVCompressConfig(method="snapkv", budget=10, buffer=4, window=3, granularity="head")],
                         ids=lambda kv: f"{kv.method}-{kv.granularity}")
def test_engine_through_the_body_equals_the_engine_through_hf(kv):
    model = perturbed(qwen2(1))
    hf = EmbeddedEngine(copy.deepcopy(model), kv, max_batch_size=3, hf_decode=True)
    ours = EmbeddedEngine(model, kv, max_batch_size=3)
    assert ours.decode_body_reason is None and hf.decode_body_reason == "hf_decode=True"
    for x, y in zip(ours.generate(PROMPTS, SAMPLE, seed=5), hf.generate(PROMPTS, SAMPLE, seed=5)):
        assert x.response_ids == y.response_ids
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        assert x.kv == y.kv
        if x.evictions is not None:
            assert torch.equal(x.evictions.keep_bits, y.evictions.keep_bits)


def test_fused_weights_are_the_hf_parameters():
    model = perturbed(qwen2())
    names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    body = DecodeBody(model)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == names  # the sync protocol's layout
    assert dict(model.named_parameters()) == params  # the same parameter objects (an optimiser keeps them)
    attn, layer = model.model.layers[0].self_attn, body.layers[0]
    q_rows = attn.q_proj.weight.shape[0]
    with torch.no_grad():
        attn.k_proj.weight[1, 2] = 123.0  # an in-place write to the HF parameter ...
        attn.v_proj.bias[0] = -7.0
    assert layer.qkv[q_rows + 1, 2] == 123.0  # ... is a write to the fused tensor
    assert layer.qkv_bias[q_rows + attn.k_proj.bias.shape[0]] == -7.0
    assert not body.stale()
    attn.k_proj.weight.data = attn.k_proj.weight.data.clone()  # a conversion that replaces the data
    assert body.stale()


@pytest.mark.parametrize("tied", [False, True])
def test_update_weights_reaches_the_fused_weights(tied):
    """An engine whose weights are updated samples what an engine built on the new weights samples: the fused copy
    follows update_weights (a tied head: one tensor provided for two names)."""
    old, new = qwen2(0, tie_word_embeddings=tied), perturbed(qwen2(7, tie_word_embeddings=tied))
    engine = EmbeddedEngine(old, KVCompressConfig(method="rkv", budget=12, buffer=4, window=3), max_batch_size=3)
    engine.generate(PROMPTS, SAMPLE, seed=1)  # a runner (and its cache) built on the old weights
    state = new.state_dict()
    if tied:
        state.pop("lm_head.weight")
    engine.update_weights(state)
    fresh = EmbeddedEngine(copy.deepcopy(new), KVCompressConfig(method="rkv", budget=12, buffer=4, window=3),
                           max_batch_size=3, hf_decode=True)
    for x, y in zip(engine.generate(PROMPTS, SAMPLE, seed=2), fresh.generate(PROMPTS, SAMPLE, seed=2)):
        assert x.response_ids == y.response_ids
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_a_replaced_weight_is_put_back_where_the_body_reads_it():
    """Data replaced at the same dtype (load_state_dict(assign=True)): copied back into the fused tensors, the body and
    the runner (its graphs) kept; a dtype conversion: a new body and a new runner (a cache of the new dtype)."""
    model = perturbed(qwen2())
    engine = EmbeddedEngine(model)
    first = engine.generate(PROMPTS, SAMPLE, seed=4)
    body = engine._decode_body
    with torch.no_grad():
        for p in model.parameters():  # new data, same parameters
            p.data = p.data.clone() * 1.25
    assert body.stale()
    fresh = EmbeddedEngine(copy.deepcopy(model), hf_decode=True).generate(PROMPTS, SAMPLE, seed=4)
    again = engine.generate(PROMPTS, SAMPLE, seed=4)
    assert engine._decode_body is body and not body.stale() and engine.runner_builds == 1
    assert [o.response_ids for o in again] == [o.response_ids for o in fresh] != [o.response_ids for o in first]
    model.double()
    fresh = EmbeddedEngine(copy.deepcopy(model), hf_decode=True).generate(PROMPTS, SAMPLE, seed=4)
    again = engine.generate(PROMPTS, SAMPLE, seed=4)
    assert engine._decode_body is not body and engine.runner_builds == 2
    assert engine._runner.cache.key.dtype == torch.float64
    assert [o.response_ids for o in again] == [o.response_ids for o in fresh]


def test_engines_sharing_a_model_share_its_fused_weights():
    """A second engine over the same model uses the first one's fused tensors: neither body goes stale, so neither
    engine builds a second runner (a rollout engine beside a dense evaluation one, --offload-rollout's wrapper)."""
    model = perturbed(qwen2())
    a, b = EmbeddedEngine(model), EmbeddedEngine(model)
    assert a._decode_body.layers[0].qkv.data_ptr() == b._decode_body.layers[0].qkv.data_ptr()
    for _ in range(2):
        assert [o.response_ids for o in a.generate(PROMPTS, SAMPLE, seed=4)] == \
            [o.response_ids for o in b.generate(PROMPTS, SAMPLE, seed=4)]
    assert not a._decode_body.stale() and not b._decode_body.stale() and a.runner_builds == b.runner_builds == 1


def test_unknown_architectures_decode_through_hf_with_a_reason():
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(**SHAPE)).eval()
    engine = EmbeddedEngine(mistral)
    assert engine.decode_body_reason.startswith("model_type 'mistral'")
    reference = EmbeddedEngine(mistral, hf_decode=True).generate(PROMPTS, SAMPLE, seed=1)
    assert [o.response_ids for o in engine.generate(PROMPTS, SAMPLE, seed=1)] == [o.response_ids for o in reference]
    dynamic = qwen2(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "varies with the sequence length" in unsupported(dynamic)
    assert build(dynamic) == (None, unsupported(dynamic))


META = torch.device("meta")


def meta_runner(kv, layers=2, body=True):
    model = Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, "num_hidden_layers": layers})).eval().to(META)
    head = hf_head_weight(model)
    shape = RunnerShape(kv, 4, 24, "eager", 4)
    return model, ModelRunner(model, shape, (20,) * layers, META, lambda h: lm_head_logits(h, head, fp32=False),
                              DecodeBody(model) if body else None)


@pytest.mark.parametrize("kv", [KVCompressConfig(), KVCompressConfig(method="rkv", budget=12, buffer=4, window=3),
                                KVCompressConfig(method="h2o", budget=12, buffer=4, window=3)],
                         ids=lambda kv: kv.method)
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_capture_guard_decode_step_through_the_body(kv, attention):
    """On the meta device the Triton attention's op runs its shape function: what the step does around it (the
    lengths from the fills) is checked."""
    model, runner = meta_runner(kv)
    runner.cache.decode_backend = attention
    with torch.inference_mode(), budget_attention_installed(model):
        for params in (SamplingParams(temperature=0.7, top_p=0.9, top_k=20), SamplingParams(temperature=0.0)):
            runner.step(4, (24, 24), params)  # the capture's eager warm-up
            with CaptureGuard(META) as guard:
                runner.step(4, (24, 24), params)
            guard.check()


def ops_per_step(body: bool, layers: int) -> int:
    model, runner = meta_runner(KVCompressConfig(), layers, body)
    params = SamplingParams(temperature=1.0)
    with torch.inference_mode(), budget_attention_installed(model):
        runner.step(4, (24,) * layers, params)
        with OpCounter() as counter:
            runner.step(4, (24,) * layers, params)
    return counter.total


def test_the_step_dispatches_at_most_half_of_hfs_operations():
    """Qwen2.5-1.5B's depth (28 layers; the count does not depend on the width): what a GPU launches per step."""
    ours, hf = ops_per_step(True, 28), ops_per_step(False, 28)
    assert ours <= hf / 2, (ours, hf)


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_new_tokens=16),
                                    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=16,
                                                   ignore_eos=True)], ids=["greedy", "sampled"])
def test_compiled_step_samples_the_eager_steps_tokens(params):
    """inductor on CPU (the GPU's cuda_graph_compile is the same compiled step, captured): fp32, dense and R-KV, the
    eager body's tokens and log-probs."""
    model = perturbed(qwen2(2))
    for kv in (KVCompressConfig(), KVCompressConfig(method="rkv", budget=12, buffer=4, window=3)):
        torch._dynamo.reset()
        eager = EmbeddedEngine(model, kv, max_batch_size=4).generate(PROMPTS, params, seed=6)
        compiled = EmbeddedEngine(model, kv, max_batch_size=4, step_mode="compile").generate(PROMPTS, params, seed=6)
        for x, y in zip(compiled, eager):
            assert x.response_ids == y.response_ids
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_cuda_graph_modes_need_cuda(monkeypatch):
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        EmbeddedEngine(qwen2(), step_mode="cuda_graph_compile")
    with pytest.raises(ValueError, match="decode_attention='flash'"):
        EmbeddedEngine(qwen2(), decode_attention="flash")
    if not torch.cuda.is_available():  # conftest runs the tests under Triton's interpreter: an engine outside them not
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs Triton and a CUDA device"):
            EmbeddedEngine(qwen2(), decode_attention="triton")
