"""The embedded rollout engine against independent references built here.

- dense: a teacher-forced full forward of the plain HF model (its own sdpa attention, no cache);
- compressed: a full forward through a hand-written attention whose mask, per layer / head / query, is
  exactly the set of positions the engine's cache held when that query ran (engine_reference.py);
- greedy: transformers' generate().
Models are tiny Qwen2 / Llama built from configs with random weights.
"""
import copy

import pytest
import torch
from tests.helpers.engine_reference import dense_logprobs, masked_reference_logprobs, traced_engine
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout import RolloutEngine, SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core box OpenMP threads that spin
    against other processes make each matmul ~20x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [list(range(20, 50)), [5, 17, 3, 9, 40], [11, 2], [7, 7, 8, 1, 60, 61, 62, 3, 4]]
SHORT_CONTEXT = 50  # with it the 30-token prompt 0 ends early (finish "length" at 50 tokens) while others run on:
# its row is then refilled by moving the last running row into it, which the continuous-batching tests need
SAMPLE = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24, ignore_eos=True)


def make_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


# ------------------------------------------------------------------------------------------------------------
# Dense exactness
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_dense_and_huge_budget_match_teacher_forcing(arch):
    model = make_model(arch)
    assert isinstance(EmbeddedEngine(model), RolloutEngine)
    outs = {}
    for name, kv in [("none", KVCompressConfig(method="none")),
                     ("rkv", KVCompressConfig(method="rkv", budget=4096, buffer=64, window=4))]:
        engine = EmbeddedEngine(model, kv, max_batch_size=3)  # 4 prompts, 3 rows: continuous batching
        outs[name] = engine.generate(PROMPTS, SAMPLE, seed=123)
    for dense, big in zip(outs["none"], outs["rkv"]):
        assert dense.response_ids == big.response_ids
        assert len(dense.response_ids) == SAMPLE.max_new_tokens and dense.finish_reason == "length"
        ref = dense_logprobs(model, dense.prompt_ids, dense.response_ids, SAMPLE.temperature)
        for out in (dense, big):
            assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)
            assert out.kv.compressions == 0
            assert out.kv.kept_kv_tokens == out.kv.dense_kv_tokens
        # dense_kv_tokens = sum over sampled tokens of the context they were computed from
        p, n = len(dense.prompt_ids), len(dense.response_ids)
        assert dense.kv.dense_kv_tokens == sum(p + t for t in range(n))
        assert dense.kv.peak_kv_tokens == p + n - 1


def test_greedy_matches_hf_generate():
    model = make_model("qwen2", seed=1)
    engine = EmbeddedEngine(model, max_batch_size=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    for out in outs:
        with torch.no_grad():
            hf = model.generate(torch.tensor([out.prompt_ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                pad_token_id=0)
        assert out.response_ids == hf[0, len(out.prompt_ids):].tolist()
        ref = dense_logprobs(model, out.prompt_ids, out.response_ids, 0.0)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# Compressed decoding: bound, logical positions, log-probs = masked dense forward
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, method, granularity",
    [("qwen2", "rkv", "head"), ("qwen2", "snapkv", "head"), ("qwen2", "streaming", "head"), ("qwen2", "h2o", "head"),
     ("llama", "rkv", "head"), ("qwen2", "rkv", "model"), ("llama", "h2o", "layer")],
)
def test_small_budget_logprobs_equal_masked_reference(arch, method, granularity):
    model = make_model(arch)
    model.config.max_position_embeddings = SHORT_CONTEXT
    kv = KVCompressConfig(method=method, budget=12, buffer=4, window=3, kernel_size=3, granularity=granularity,
                          n_sink=2 if method == "streaming" else None)
    engine, records = traced_engine(model, kv, max_batch_size=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True)
    outs = engine.generate(PROMPTS, params, seed=5)
    assert [len(o.response_ids) for o in outs] == [SHORT_CONTEXT - len(PROMPTS[0]), 30, 30, 30]
    bound = kv.budget + kv.buffer
    drift = 0.0
    for i, out in enumerate(outs):
        recs = records[i]
        assert out.kv.peak_kv_tokens <= bound
        assert out.kv.compressions > 0 and out.kv.kept_kv_tokens < out.kv.dense_kv_tokens
        for rec in recs:
            held = rec.held_positions
            assert held.shape[-1] <= bound
            # logical positions: slots sorted, distinct, never ahead of the newest query; the newest token is held
            assert bool((held[..., 1:] > held[..., :-1]).all())
            assert int(held.max()) == rec.query_positions[-1]
        decode_positions = [r.query_positions[0] for r in recs if len(r.query_positions) == 1
                            and r.query_positions[0] >= len(out.prompt_ids)]
        assert decode_positions == list(range(len(out.prompt_ids), len(out.prompt_ids) + len(out.response_ids) - 1))
        ref = masked_reference_logprobs(model, recs, out.prompt_ids, out.response_ids, params.temperature)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0), method
        dense = dense_logprobs(model, out.prompt_ids, out.response_ids, params.temperature)
        drift = max(drift, float((dense - torch.tensor(out.logprobs)).abs().max()))
    assert drift > 1e-3  # the budget really changed what the sampler saw (the test would catch a dense cache)


def test_long_prompt_is_prefilled_in_chunks_within_bound():
    model = make_model("qwen2")
    kv = KVCompressConfig(method="snapkv", budget=10, buffer=4, window=2)
    engine, records = traced_engine(model, kv)
    prompt = list(range(1, 41))  # 40 tokens > budget + buffer = 14
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))[0]
    prefill = [r for r in records[0] if r.query_positions[0] < len(prompt)]
    assert [len(r.query_positions) for r in prefill] == [14, 4, 4, 4, 4, 4, 4, 2]
    assert max(r.held_positions.shape[-1] for r in records[0]) <= 14
    ref = masked_reference_logprobs(model, records[0], prompt, out.response_ids, 0.0)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)
    # SnapKV compressed the finished prompt (fill 12 > budget 10) before the first decode step
    first_decode = next(r for r in records[0] if r.query_positions == [len(prompt)])
    assert first_decode.held_positions.shape[-1] == kv.budget + 1


# ------------------------------------------------------------------------------------------------------------
# Determinism, batching, stopping, weights
# ------------------------------------------------------------------------------------------------------------
def test_seed_determinism_and_batch_invariance():
    model = make_model("qwen2")
    model.config.max_position_embeddings = SHORT_CONTEXT  # unequal lengths: rows move under continuous batching
    kv = KVCompressConfig(method="rkv", budget=10, buffer=4, window=2)
    a = EmbeddedEngine(model, kv, max_batch_size=3).generate(PROMPTS, SAMPLE, seed=42)
    b = EmbeddedEngine(model, kv, max_batch_size=3).generate(PROMPTS, SAMPLE, seed=42)
    one_row = EmbeddedEngine(model, kv, max_batch_size=1).generate(PROMPTS, SAMPLE, seed=42)
    c = EmbeddedEngine(model, kv, max_batch_size=3).generate(PROMPTS, SAMPLE, seed=43)
    assert len(a[0].response_ids) < len(a[1].response_ids)
    assert [o.response_ids for o in a] == [o.response_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    # each sample owns a generator seeded from (seed, index): batching does not change what it draws
    assert [o.response_ids for o in a] == [o.response_ids for o in one_row]
    for x, y in zip(a, one_row):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    assert [o.response_ids for o in a] != [o.response_ids for o in c]


def test_stop_ids_and_length_with_unequal_lengths():
    model = make_model("qwen2")
    engine = EmbeddedEngine(model, max_batch_size=2)
    free = engine.generate(PROMPTS, SAMPLE, seed=9)
    stop = free[0].response_ids[4]  # stop at (the first occurrence of) the 5th token of sample 0
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24, stop_token_ids=(stop,), ignore_eos=True)
    outs = engine.generate(PROMPTS, params, seed=9)
    for f, o in zip(free, outs):
        if stop in f.response_ids:
            cut = f.response_ids.index(stop) + 1
            assert o.finish_reason == "stop" and o.response_ids == f.response_ids[:cut]
            assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(f.logprobs[:cut]), atol=1e-5)
        else:
            assert o.finish_reason == "length" and o.response_ids == f.response_ids
    assert outs[0].finish_reason == "stop" and len(outs[0].response_ids) <= 5
    assert sum(o.finish_reason == "length" for o in outs) >= 1  # unequal lengths: rows were moved and reused
    # without ignore_eos the model's EOS id stops generation too
    model.generation_config.eos_token_id = stop
    eos_out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24), seed=9)
    assert eos_out[0].finish_reason == "stop" and eos_out[0].response_ids == outs[0].response_ids
    assert engine.generate(PROMPTS[:1], SAMPLE, seed=9)[0].response_ids == free[0].response_ids  # ignore_eos


def test_context_limit_ends_with_length():
    model = make_model("qwen2")
    model.config.max_position_embeddings = 12
    out = EmbeddedEngine(model).generate([[1, 2, 3, 4, 5]], SAMPLE, seed=0)[0]
    assert out.finish_reason == "length" and len(out.prompt_ids) + len(out.response_ids) == 12


def test_update_weights_changes_outputs_and_version():
    model = make_model("qwen2")
    engine = EmbeddedEngine(model)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = engine.generate(PROMPTS[:2], params)
    assert engine.weight_version == 0 and all(o.weight_version == 0 for o in before)
    other = make_model("qwen2", seed=7)
    weights = {k: v.clone() for k, v in other.state_dict().items()}
    ptr = next(model.parameters()).data_ptr()
    engine.update_weights(weights)
    assert next(model.parameters()).data_ptr() == ptr  # in place, no rebuild
    after = engine.generate(PROMPTS[:2], params)
    assert engine.weight_version == 1 and all(o.weight_version == 1 for o in after)
    assert [o.response_ids for o in after] != [o.response_ids for o in before]
    with torch.no_grad():
        ref = other.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    assert after[0].response_ids == ref[0, len(PROMPTS[0]):].tolist()
    with pytest.raises(ValueError, match="unknown weight names"):
        engine.update_weights({"not.a.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing weights"):
        engine.update_weights({k: v for k, v in weights.items() if "layers.0.mlp" not in k})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({**weights, "model.norm.weight": torch.ones(3)})


def test_tied_embeddings_accept_state_dict_without_alias():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)).eval()
    engine = EmbeddedEngine(model)
    weights = {k: torch.randn_like(v) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    engine.update_weights(weights)
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------
def test_bad_prompts():
    model = make_model("qwen2")
    engine = EmbeddedEngine(model, max_prompt_len=16)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], params)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 96\)"):
        engine.generate([[1, 96]], params)
    with pytest.raises(ValueError, match=r"prompt 1 has 20 tokens, over the limit of 16"):
        engine.generate([[1], list(range(20))], params)
    ctx = EmbeddedEngine(model)
    with pytest.raises(ValueError, match=r"prompt 0 has 300 tokens, over the limit of 255.*position_embeddings=256"):
        ctx.generate([[1] * 300], params)
    with pytest.raises(ValueError, match="--rollout-top-p"):
        engine.generate([[1]], SamplingParams(top_p=0.0))


def test_skip_long_prompts():
    model = make_model("qwen2")
    engine = EmbeddedEngine(model, max_prompt_len=16, on_long_prompt="skip")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    outs = engine.generate([[1, 2, 3], list(range(20)), [4, 5]], params, seed=0)
    assert [o.finish_reason for o in outs] == ["length", "skipped", "length"]
    assert outs[1].response_ids == [] and outs[1].logprobs == [] and outs[1].prompt_ids == list(range(20))
    assert engine.num_skipped_prompts == 1
    assert engine.generate([list(range(17))], SamplingParams(max_new_tokens=4), seed=0)[0].finish_reason == "skipped"
    assert engine.num_skipped_prompts == 2


def test_bad_constructor_arguments():
    model = make_model("qwen2")
    with pytest.raises(ValueError, match="on_long_prompt"):
        EmbeddedEngine(model, on_long_prompt="truncate")
    with pytest.raises(ValueError, match="max_batch_size"):
        EmbeddedEngine(model, max_batch_size=0)
    with pytest.raises(ValueError, match="--kv-budget"):
        EmbeddedEngine(model, KVCompressConfig(method="rkv", budget=4, window=8))
    with pytest.raises(ValueError, match="not a local directory"):
        EmbeddedEngine.from_pretrained("/nonexistent/model")
    sliding = Qwen2ForCausalLM(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    with pytest.raises(ValueError, match="sliding_attention"):
        EmbeddedEngine(sliding)


# ------------------------------------------------------------------------------------------------------------
# Loading from a directory, bf16
# ------------------------------------------------------------------------------------------------------------
def test_from_pretrained_directory(tmp_path):
    model = make_model("llama")
    model.save_pretrained(tmp_path)
    engine = EmbeddedEngine.from_pretrained(tmp_path, KVCompressConfig(method="none"), max_batch_size=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    assert [o.response_ids for o in engine.generate(PROMPTS, params)] == \
        [o.response_ids for o in EmbeddedEngine(model).generate(PROMPTS, params)]
    assert model.config._attn_implementation == "sdpa"  # our attention is installed only inside generate()


def test_bf16_runs_and_tracks_fp32():
    model = make_model("qwen2")
    kv = KVCompressConfig(method="rkv", budget=12, buffer=4, window=3)
    engine = EmbeddedEngine(copy.deepcopy(model), kv, dtype=torch.bfloat16, max_batch_size=2)
    assert engine.model.dtype == torch.bfloat16
    outs = engine.generate(PROMPTS, SAMPLE, seed=3)
    for out in outs:
        assert len(out.response_ids) == SAMPLE.max_new_tokens and out.kv.peak_kv_tokens <= 16
        lp = torch.tensor(out.logprobs)
        assert torch.isfinite(lp).all() and (lp <= 0).all()
    # prompts that fit the cache are prefilled densely: their first-token log-probs agree with the fp32 model
    # to bf16 precision (prompt 0 is longer than budget + buffer and compressed during prefill)
    short = outs[1:]
    first = torch.tensor([o.logprobs[0] for o in short])
    ref = torch.stack([dense_logprobs(model, o.prompt_ids, o.response_ids[:1], SAMPLE.temperature)[0] for o in short])
    assert torch.allclose(first, ref, atol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rkv", "snapkv", "streaming", "h2o"])
def test_long_generation_matches_masked_reference(method):
    """Many compression cycles at a realistic budget / buffer ratio on a 4-layer model."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, "num_hidden_layers": 4, "max_position_embeddings": 512})).eval()
    kv = KVCompressConfig(method=method, budget=48, buffer=16, window=8)
    engine, records = traced_engine(model, kv, max_batch_size=3)
    prompts = [list(range(1, 81)), [3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 60)), [2] * 33]
    params = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True)
    outs = engine.generate(prompts, params, seed=11)
    for i, out in enumerate(outs):
        assert out.kv.peak_kv_tokens <= kv.budget + kv.buffer and out.kv.compressions >= 8
        ref = masked_reference_logprobs(model, records[i], out.prompt_ids, out.response_ids, params.temperature)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# GRPO groups: the n samples of a prompt share one prefill
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", [
    KVCompressConfig(method="none"),
    KVCompressConfig(method="rkv", budget=12, buffer=4, window=3, kernel_size=3),
    KVCompressConfig(method="snapkv", budget=10, buffer=4, window=2),  # compresses the prompt once it is prefilled
    KVCompressConfig(method="h2o", budget=12, buffer=4, window=3),
], ids=lambda kv: kv.method)
def test_shared_prefill_equals_separate_prefills(kv):
    model = make_model("qwen2")
    long_prompt = list(range(1, 41))  # 40 tokens: chunked prefill with compressions under every budget above
    prompts = [PROMPTS[1]] * 3 + [long_prompt] * 2 + [PROMPTS[3]]
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    engine, records = traced_engine(model, kv, max_batch_size=4)  # the second group is split by admission
    outs = engine.generate(prompts, params, seed=7)
    assert engine.last_stats.prefill_tokens_saved > 0
    assert engine.last_stats.prefill_tokens + engine.last_stats.prefill_tokens_saved == sum(map(len, prompts))
    for i, out in enumerate(outs):
        alone = EmbeddedEngine(model, kv).generate([prompts[i]], params, seed=7, index_offset=i)[0]
        assert out.response_ids == alone.response_ids
        assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
        assert out.kv == alone.kv
        if kv.enabled:  # the copied cache is what the sample attended to: the masked reference agrees
            ref = masked_reference_logprobs(model, records[i], out.prompt_ids, out.response_ids, params.temperature)
            assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    assert [o.response_ids for o in engine.generate(prompts, greedy)] == \
        [EmbeddedEngine(model, kv).generate([p], greedy)[0].response_ids for p in prompts]
