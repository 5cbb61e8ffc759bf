"""One next-token head for the sampler and both learners (slime_sparse/utils/lm_head.py, --enable-fp32-lm-head)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from slime_sparse.algo import LossConfig
from slime_sparse.backends.base import TrainBatch
from slime_sparse.backends.embedded.learner import EmbeddedLearner
from slime_sparse.backends.logprobs import response_logprobs
from slime_sparse.backends.optimizer import OptimConfig
from slime_sparse.config_loader import load_config
from slime_sparse.factory import EngineSpec, LearnerSpec
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.utils.lm_head import hf_head_weight, lm_head_logits, tempered_log_softmax


def test_fp32_head_is_the_exact_product_of_the_bf16_operands():
    torch.manual_seed(0)
    hidden = (torch.randn(3, 5, 64) * 4).bfloat16()
    weight = torch.randn(1000, 64).bfloat16()
    exact = hidden.double() @ weight.double().T  # bf16 values are exact in fp32 and fp64
    fp32 = lm_head_logits(hidden, weight, fp32=True)
    assert fp32.dtype == torch.float32
    torch.testing.assert_close(fp32.double(), exact, rtol=1e-6, atol=1e-5)
    rounded = lm_head_logits(hidden, weight, fp32=False)
    assert rounded.dtype == torch.float32 and torch.equal(rounded, F.linear(hidden, weight).float())
    assert torch.equal(rounded, rounded.bfloat16().float())  # what the flag removes: logits on bf16's grid
    assert (rounded.double() - exact).abs().max() > 10 * (fp32.double() - exact).abs().max()


def test_fp32_head_gradients_reach_the_bf16_weight():
    torch.manual_seed(0)
    hidden = torch.randn(4, 16).bfloat16().requires_grad_()
    weight = torch.randn(32, 16).bfloat16().requires_grad_()
    lm_head_logits(hidden, weight, fp32=True).square().sum().backward()
    ref_h, ref_w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    (ref_h @ ref_w.T).square().sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(weight.grad.double(), ref_w.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(hidden.grad.double(), ref_h.grad, rtol=1e-2, atol=1e-2)


def test_tempered_log_softmax_is_the_samplers_convention():
    logits = torch.tensor([[2.0, 1.0, -1.0]]).bfloat16()
    assert tempered_log_softmax(logits, 0.5).dtype == torch.float32
    torch.testing.assert_close(tempered_log_softmax(logits, 0.5), torch.log_softmax(logits.float() / 0.5, -1))
    torch.testing.assert_close(tempered_log_softmax(logits, 0.0), torch.log_softmax(logits.float(), -1))  # greedy


def test_heads_that_change_logits_after_the_projection_are_refused():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert hf_head_weight(model) is model.lm_head.weight
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="logit_scale"):
        hf_head_weight(model)


def _head_only_llama() -> torch.nn.Module:
    """A bf16 Llama whose one decoder layer adds nothing to the residual stream (its output projections are zero):
    the sampler's and the learner's hidden states are then the same bits (the embedding's RMSNorm), so whatever
    differs in their log-probs comes from the head. Its untied head gives logits of magnitude ~10-30, where bf16's
    grid is 0.06-0.125 wide."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                         max_position_embeddings=256))
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(60.0)
    return model.to(torch.bfloat16).eval()


def _engine_minus_learner(model, engine_fp32: bool, learner_fp32: bool) -> torch.Tensor:
    prompts = [[(5 * i + 3 * j) % 500 + 1 for j in range(12 + i)] for i in range(4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    outs = EmbeddedEngine(model, fp32_lm_head=engine_fp32).generate(prompts, params, seed=0)
    tokens = [o.prompt_ids + o.response_ids for o in outs]
    lens = [len(o.response_ids) for o in outs]
    with torch.no_grad():
        learner, _ = response_logprobs(model, tokens, lens, temperature=1.0, fp32_lm_head=learner_fp32)
    return torch.cat([torch.tensor(o.logprobs) - learner[i, :n] for i, (n, o) in enumerate(zip(lens, outs))])


def test_engine_and_learner_share_the_head_bit_for_bit():
    """The engine's recorded log-probs are the learner's formula exactly, with the flag on and off; a head that
    differs between the two sides (SGLang with the flag, a learner without) shows up at once."""
    model = _head_only_llama()
    for fp32 in (False, True):
        assert torch.equal(_engine_minus_learner(model, fp32, fp32), torch.zeros(96))
    assert _engine_minus_learner(model, True, False).abs().max() > 1e-2


def test_the_flag_changes_nothing_in_fp32():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         max_position_embeddings=128)).eval()
    prompts = [[3, 5, 7, 9], [11, 13, 17]]
    params = SamplingParams(temperature=0.8, max_new_tokens=16, ignore_eos=True)
    off, on = (EmbeddedEngine(model, fp32_lm_head=f).generate(prompts, params, seed=1) for f in (False, True))
    assert [o.response_ids for o in off] == [o.response_ids for o in on]
    assert [o.logprobs for o in off] == [o.logprobs for o in on]


def test_training_with_the_fp32_head_steps_a_tied_bf16_model():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         max_position_embeddings=128)).to(torch.bfloat16)
    learner = EmbeddedLearner(model, LossConfig(), optim=OptimConfig(lr=1e-3), fp32_lm_head=True)
    tokens, lens = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], [3, 2]
    old = learner.compute_logprobs(tokens, lens)
    before = model.model.embed_tokens.weight.detach().clone()
    metrics = learner.train_step(TrainBatch(tokens=tokens, response_lens=lens, advantages=torch.tensor([1.0, -1.0]),
                                            loss_masks=[torch.ones(n) for n in lens], old_logprobs=old))
    assert metrics["train/grad_norm"] > 0
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one (bf16) parameter
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not torch.equal(before, model.model.embed_tokens.weight.detach())


@pytest.mark.parametrize("flag", ["--enable-fp32-lm-head", "--sglang-enable-fp32-lm-head"])
def test_one_flag_sets_the_head_of_engine_learner_and_sglang_servers(base_args, flag):
    """slime users pass SGLang's flag as --sglang-enable-fp32-lm-head, which alone would leave the learner in bf16:
    here either spelling sets both sides, and the servers get the flag once."""
    cfg = load_config(base_args + [flag])
    assert cfg.train.enable_fp32_lm_head
    assert LearnerSpec.from_run(cfg).train.enable_fp32_lm_head
    engine = EngineSpec.from_run(cfg)
    assert engine.fp32_lm_head and engine.sglang.extra_args.count("--enable-fp32-lm-head") == 1
    assert cfg.sglang.extra_args == ()  # not passed through on its own
    default = load_config(base_args)
    assert not default.train.enable_fp32_lm_head
    assert "--enable-fp32-lm-head" not in EngineSpec.from_run(default).sglang.extra_args
