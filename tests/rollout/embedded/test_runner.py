"""The runner outlives a generate() call, and KV memory decides how many sequences decode at once (#33)."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.kv import KVCompressConfig, row_capacity
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.kv.engine_memory import engine_bytes
from slime_sparse.rollout.embedded.runner import row_bytes

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
RKV = KVCompressConfig(method="rkv", budget=12, buffer=4, window=3, kernel_size=3)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)


def model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 96, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_a_second_call_reuses_the_runner_and_another_kv_config_replaces_it():
    engine = EmbeddedEngine(model(), RKV, max_batch_size=4)
    first = engine.generate(prompts(6), PARAMS, seed=1)
    runner = engine._runner
    again = engine.generate(prompts(6), PARAMS, seed=1)
    assert engine._runner is runner  # same cache, state, compressor (and, on CUDA, graphs)
    assert [o.response_ids for o in again] == [o.response_ids for o in first]
    assert [o.evictions.keep_bits.tolist() for o in again] == [o.evictions.keep_bits.tolist() for o in first]
    engine.generate(prompts(3), PARAMS, seed=2)  # fewer sequences, same config: still fits
    assert engine._runner is runner
    dense = engine.with_kv(KVCompressConfig()).generate(prompts(3), PARAMS, seed=2)
    assert engine._runner is not runner and not engine._runner.shape.kv.enabled and dense[0].evictions is None
    engine.release_memory()
    assert engine._runner is None and engine.captures == 0


def memory_for(m, kv: KVCompressConfig, longest: int, rows: int, prompt: int = 11) -> float:
    """GiB that hold `rows` rows of this config and every working set (kv/engine_memory.py)."""
    spec = EmbeddedEngine(m, kv).memory_spec(kv, row_capacity(kv, longest), prompt, PARAMS)
    return sum(engine_bytes(spec, rows).values()) / 2**30


@pytest.mark.parametrize("kv", [KVCompressConfig(), RKV], ids=["dense", "rkv"])
def test_kv_memory_admits_the_rows_that_fit_and_draws_the_same_tokens(kv):
    m = model()
    batch = prompts(12)
    longest = max(map(len, batch)) + PARAMS.max_new_tokens
    gib = memory_for(m, kv, longest, 5, max(map(len, batch)))  # room for five rows of this config, not six
    assert row_bytes(m.config, kv, row_capacity(kv, longest), torch.float32) * 6 < gib * 2**30  # KV alone: six
    engine = EmbeddedEngine(m, kv, max_batch_size=None, kv_cache_gib=gib)
    out = engine.generate(batch, PARAMS, seed=3)
    assert engine.last_stats.rows == 5
    reference = EmbeddedEngine(m, kv, max_batch_size=5).generate(batch, PARAMS, seed=3)
    assert [o.response_ids for o in out] == [o.response_ids for o in reference]
    capped = EmbeddedEngine(m, kv, max_batch_size=3, kv_cache_gib=gib)
    capped.generate(batch, PARAMS, seed=3)
    assert capped.last_stats.rows == 3  # --rollout-max-batch-size still caps


def test_compression_turns_kv_memory_into_concurrency():
    m = model()
    longest = 11 + PARAMS.max_new_tokens
    gib = memory_for(m, KVCompressConfig(), longest, 8)
    dense = EmbeddedEngine(m, max_batch_size=None, kv_cache_gib=gib)
    sparse = EmbeddedEngine(m, RKV, max_batch_size=None, kv_cache_gib=gib)
    assert dense.rows_for(KVCompressConfig(), longest, 11, PARAMS) == 8
    # 51 slots dense against 16 compressed (plus the query ring); this tiny model's working sets (a prefill, a
    # decode step) weigh as much as a few dense rows' KV, and compressed rows take the rest: 11 rows
    assert sparse.rows_for(RKV, longest, 11, PARAMS) >= 10


def test_bad_memory_settings_name_the_flag():
    m = model()
    with pytest.raises(ValueError, match="--rollout-kv-cache-gib and --rollout-mem-fraction"):
        EmbeddedEngine(m, kv_cache_gib=1, mem_fraction=0.5)
    with pytest.raises(ValueError, match="--rollout-kv-cache-gib"):
        EmbeddedEngine(m, kv_cache_gib=0)
    with pytest.raises(ValueError, match="holds no row"):
        EmbeddedEngine(m, kv_cache_gib=1e-9).generate(prompts(2), PARAMS, seed=0)


def test_long_prompts_compress_together_while_prefilling():
    """Prompts longer than a row's capacity are prefilled in chunks, and the rows that fill up in the same chunk
    compress in one call (#33: they were compressed one by one)."""
    engine = EmbeddedEngine(model(), RKV, max_batch_size=8)
    g = torch.Generator().manual_seed(5)
    long_prompts = [torch.randint(1, 96, (60,), generator=g).tolist() for _ in range(8)]
    engine.generate(long_prompts, SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True), seed=0)
    stats = engine.last_stats
    # 60 tokens through a 16-slot row: chunks of 16, then 4 at a time after each cut to 12, all 8 rows in step
    assert stats.compressions >= 8 * 10
    assert stats.compaction_calls * 8 == stats.compressions


def test_a_call_split_across_engines_draws_the_same_tokens():
    """Sample i draws from the stream of (seed, index_offset + i): a call split in two (as Ray splits one across its
    engine actors) draws the tokens, log-probs and eviction records of the whole call."""
    m = model()
    batch = prompts(6)
    whole = EmbeddedEngine(m, RKV, max_batch_size=4).generate(batch, PARAMS, seed=11)
    first = EmbeddedEngine(m, RKV, max_batch_size=2).generate(batch[:3], PARAMS, seed=11, index_offset=0)
    second = EmbeddedEngine(m, RKV, max_batch_size=3).generate(batch[3:], PARAMS, seed=11, index_offset=3)
    for a, b in zip(whole, first + second):
        assert a.response_ids == b.response_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert torch.equal(a.evictions.keep_bits, b.evictions.keep_bits)
