"""The learner's shadow forward recomputes the sampler's log-probs from the engine's eviction record.

References: the sampler's own log-probs (recorded at sampling under the compressed cache), and the engine's opt-in
kv_trace (what each row held after every forward), independent of the record.
"""
import pytest
import torch

from slime_sparse.backends.logprobs import response_logprobs
from slime_sparse.kv import GRANULARITIES, KVCompressConfig
from slime_sparse.kv.record import EvictionRecord, visible_positions
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine, KVTraceRecord
from tests.helpers.shadow import PROMPTS, TINY, shadow_error, tiny_model

SAMPLE = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=40, ignore_eos=True)
METHODS = ["snapkv", "rkv", "streaming", "h2o"]


def kv_config(method: str, granularity: str) -> KVCompressConfig:
    return KVCompressConfig(method=method, budget=12, buffer=5, window=3, kernel_size=3, granularity=granularity)


def generate(model, kv, prompts=PROMPTS, **kwargs):
    traces: dict[int, list[KVTraceRecord]] = {}
    engine = EmbeddedEngine(model, kv, max_batch_size=3, kv_trace=lambda r: traces.setdefault(r.sample_index, []).append(r),
                            **kwargs)
    return engine.generate(prompts, SAMPLE, seed=7), traces


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("method", METHODS)
def test_shadow_recompute_equals_sampler_logprobs(method, granularity):
    model = tiny_model()
    outs, _ = generate(model, kv_config(method, granularity))
    assert all(o.evictions is not None and o.evictions.starts.numel() == o.kv.compressions for o in outs)
    assert shadow_error(model, outs, SAMPLE.temperature) < 1e-5
    sampler = torch.nn.utils.rnn.pad_sequence([torch.tensor(o.logprobs) for o in outs], batch_first=True)
    with torch.no_grad():
        dense, _ = response_logprobs(model, [o.prompt_ids + o.response_ids for o in outs],
                                     [len(o.response_ids) for o in outs], temperature=SAMPLE.temperature)
    assert (dense - sampler).abs().max() > 1e-2  # the cache did change what the sampler saw


@pytest.mark.parametrize("kv", [
    KVCompressConfig(method="pyramidkv", budget=12, buffer=5, window=3, kernel_size=3, pyramid_beta=3.0),
    KVCompressConfig(method="rkv", budget=12, buffer=5, window=3, kernel_size=3, budget_schedule="pyramid",
                     pyramid_beta=3.0, granularity="layer"),
    KVCompressConfig(method="h2o", budget=12, buffer=5, window=3, budget_schedule="explicit", layer_budgets=(16, 8)),
    # kvpress's pyramid (the window inside it): [20, 4] against ours [18, 6]
    KVCompressConfig.from_preset("kvpress", method="pyramidkv", budget=12, buffer=5, window=3, kernel_size=3,
                                 pyramid_beta=3.0),
], ids=["pyramidkv", "rkv-pyramid-layer", "h2o-explicit", "pyramidkv-kvpress"])
def test_per_layer_budgets_keep_the_engine_exact(kv):
    """Per-layer budgets (#30) in the embedded engine: each layer holds its own budget, the sampler's log-probs equal
    the masked reference of what each layer held (kv_trace) and the learner's shadow recompute of the record."""
    from tests.helpers.engine_reference import masked_reference_logprobs
    from slime_sparse.kv import layer_budgets

    model = tiny_model()
    outs, traces = generate(model, kv)
    budgets = layer_budgets(kv, TINY["num_hidden_layers"])
    assert len(set(budgets)) > 1
    for i, out in enumerate(outs):
        assert out.kv.compressions > 0 and out.kv.peak_kv_tokens <= max(budgets) + kv.buffer
        sizes = {tuple(h.shape[-1] for h in rec.held_positions) for rec in traces[i]}
        assert any(a != b for a, b in sizes)  # the layers held different numbers of slots
        ref = masked_reference_logprobs(model, traces[i], out.prompt_ids, out.response_ids, SAMPLE.temperature)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)
        assert out.evictions.layer_budgets == budgets or out.evictions.shape[0] == 1
    assert shadow_error(model, outs, SAMPLE.temperature) < 1e-5


@pytest.mark.parametrize("method", ["keydiff", "streaming"])
def test_no_protected_window_keeps_the_engine_exact(method):
    """kvpress's KeyDiff and StreamingLLM protect no recent slots (the `kvpress` preset): the engine still records
    exactly what it held, and KeyDiff does evict recent tokens that a protected window would have kept."""
    from tests.helpers.engine_reference import masked_reference_logprobs

    kv = KVCompressConfig.from_preset("kvpress", method=method, budget=12, buffer=5, window=3, kernel_size=3)
    assert kv.protected_window == 0
    model = tiny_model()
    outs, traces = generate(model, kv)
    recent_dropped = 0
    for i, out in enumerate(outs):
        assert out.kv.compressions > 0
        ref = masked_reference_logprobs(model, traces[i], out.prompt_ids, out.response_ids, SAMPLE.temperature)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)
        for rec in traces[i]:
            q = rec.query_positions[-1]
            recent = torch.arange(max(q - kv.window, 0), q)  # what a protected window keeps before q is written
            recent_dropped += int((~torch.isin(recent, rec.held_positions)).any())
    assert (recent_dropped > 0) == (method == "keydiff")
    assert shadow_error(model, outs, SAMPLE.temperature) < 1e-5


@pytest.mark.parametrize("method", ["snapkv", "rkv"])
def test_samples_of_one_prompt_share_the_prefill_records(method):
    """GRPO's n samples of a prompt share one prefill (its compressions included, here a chunked one and SnapKV's
    first-decode one): every sample's record still reproduces its own log-probs."""
    model = tiny_model()
    outs, _ = generate(model, kv_config(method, "head"), prompts=[PROMPTS[0]] * 3 + [PROMPTS[3]] * 3)
    assert len({tuple(o.response_ids) for o in outs}) == 6  # different samples
    first = [o.evictions.kept_positions()[0] for o in outs[:3]]
    assert all(torch.equal(first[0], k) for k in first)  # the shared prefill's compression, in every record
    assert shadow_error(model, outs, SAMPLE.temperature) < 1e-5


@pytest.mark.parametrize("method,granularity", [("rkv", "head"), ("snapkv", "layer"), ("h2o", "model")])
def test_record_mask_is_what_the_cache_held(method, granularity):
    """Query q of layer l, head h sees exactly the positions <= q the row held after q's forward (kv_trace)."""
    outs, traces = generate(tiny_model(), kv_config(method, granularity))
    for i, out in enumerate(outs):
        total = len(out.prompt_ids) + len(out.response_ids) - 1  # the last sampled token never runs
        n_layers, n_heads = traces[i][0].held_positions.shape[:2]
        for layer in range(n_layers):
            mask = visible_positions(out.evictions, total, layer).expand(n_heads, total, total)
            for rec in traces[i]:
                for q in rec.query_positions:
                    for h in range(n_heads):
                        held = rec.held_positions[layer, h].long()
                        expected = torch.zeros(total, dtype=torch.bool)
                        expected[held[held <= q]] = True
                        assert torch.equal(mask[h, q], expected), (i, layer, h, q)


def test_record_granularity_collapses_dimensions():
    """Stored once per layer / once for the model when the method's selection is shared; bits, not positions."""
    model = tiny_model()
    shapes = {}
    for method, granularity in [("rkv", "head"), ("rkv", "layer"), ("rkv", "model"), ("streaming", "head")]:
        outs, _ = generate(model, kv_config(method, granularity), prompts=PROMPTS[:1])
        rec = outs[0].evictions
        kept = rec.kept_positions()
        assert rec.shape[-1] == 12 and kept.shape == (rec.starts.numel(), *rec.shape)
        assert rec.nbytes < kept.numel() * 2  # under int16 positions (one bit per slot it chose from)
        shapes[(method, granularity)] = rec.shape[:2]
    assert shapes == {("rkv", "head"): (2, 2), ("rkv", "layer"): (2, 1), ("rkv", "model"): (1, 1),
                      ("streaming", "head"): (1, 1)}


def test_dense_engine_has_no_record_and_shadow_is_dense():
    model = tiny_model()
    outs, _ = generate(model, KVCompressConfig(method="none"))
    assert all(o.evictions is None for o in outs)
    tokens = [o.prompt_ids + o.response_ids for o in outs]
    lens = [len(o.response_ids) for o in outs]
    with torch.no_grad():
        shadow, _ = response_logprobs(model, tokens, lens, temperature=0.9, shadow=[None] * len(outs))
        dense, _ = response_logprobs(model, tokens, lens, temperature=0.9)
    assert (shadow - dense).abs().max() < 1e-5


def test_shadow_forward_has_gradients_and_restores_attention():
    model = tiny_model()
    outs, _ = generate(model, kv_config("rkv", "head"), prompts=PROMPTS[:2])
    before = model.config._attn_implementation
    logp, _ = response_logprobs(model, [o.prompt_ids + o.response_ids for o in outs],
                                [len(o.response_ids) for o in outs], temperature=0.9, shadow=[o.evictions for o in outs])
    logp.sum().backward()
    assert model.config._attn_implementation == before
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_record_round_trip():
    g = torch.Generator().manual_seed(0)
    events, held = [], torch.arange(11).expand(3, 2, -1)  # 3 layers x 2 heads, budget 6, prompt of 11 tokens
    start = 11
    for e in range(5):
        choice = torch.rand(held.shape, generator=g).argsort(dim=-1)[..., :6].sort(dim=-1).values
        kept = held.gather(-1, choice)
        events.append((start, kept))
        held = torch.cat([kept, torch.arange(start, start + 4 + e).expand(3, 2, -1)], dim=-1)
        start += 4 + e
    rec = EvictionRecord.from_events(events)
    assert torch.equal(rec.kept_positions(), torch.stack([k for _, k in events]))
    assert rec.nbytes == (3 * 2 * (11 + 10 + 11 + 12 + 13) + 7) // 8 + 5 * 4


def test_bad_records_are_rejected():
    with pytest.raises(ValueError, match="did not hold"):
        EvictionRecord.from_events([(4, torch.tensor([[[0, 5]]]))])
    with pytest.raises(ValueError, match="did not hold"):  # position 1 was evicted by the first compression
        EvictionRecord.from_events([(4, torch.tensor([[[0, 2]]])), (6, torch.tensor([[[1, 4]]]))])
    with pytest.raises(ValueError, match="out of order"):
        EvictionRecord.from_events([(6, torch.tensor([[[0, 1]]])), (4, torch.tensor([[[0, 1]]]))])
    rec = EvictionRecord.from_events([(4, torch.tensor([[[0, 1], [1, 2]], [[0, 2], [1, 2]], [[0, 3], [1, 2]]]))])  # 3 x 2
    model = tiny_model()  # 2 layers
    with pytest.raises(ValueError, match="sample 0: eviction record has 3 layers"):
        response_logprobs(model, [[1, 2, 3, 4, 5, 6]], [2], shadow=[rec])


def _oracle_records(model, kv, prompts=PROMPTS):
    """The engine's outputs, and per sample the records rebuilt by the event-based oracle (`from_events`) from the
    positions the cache held right after each compaction (read from the cache, not from the keep bits)."""
    from slime_sparse.rollout.embedded import scheduler as scheduler_module

    events: dict[int, list] = {}
    original = scheduler_module.Scheduler._compress

    def recording(self, cut, decode=False):  # the scheduler's plan is a generator of work orders: pass them through
        yield from original(self, cut, decode)
        for row, owners in cut:
            held = self.rows.held_positions(row)
            for seq in owners:
                events.setdefault(seq.index, []).append([h.clone() for h in held])

    scheduler_module.Scheduler._compress = recording
    try:
        outs = EmbeddedEngine(model, kv, max_batch_size=3).generate(prompts, SAMPLE, seed=7)
    finally:
        scheduler_module.Scheduler._compress = original
    oracles = []
    for i, out in enumerate(outs):
        starts = out.evictions.starts.tolist() if out.evictions is not None else []
        oracles.append(EvictionRecord.from_events(list(zip(starts, events.get(i, [])[: len(starts)]))))
    return outs, oracles


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("method", ["snapkv", "rkv", "streaming", "h2o", "pyramidkv", "keydiff"])
def test_device_record_equals_the_event_based_oracle(method, granularity):
    """The keep bits built on the device inside compaction decode to the positions the cache kept, compression by
    compression, layer by layer and head by head (what `EvictionRecord.from_events` encodes from those positions)."""
    if method == "pyramidkv" and granularity == "model":
        pytest.skip("one set for every layer cannot be kept at per-layer budgets (the config refuses it)")
    model = tiny_model()
    kv = KVCompressConfig(method=method, budget=12, buffer=5, window=3, kernel_size=3, granularity=granularity)
    outs, oracles = _oracle_records(model, kv)
    assert any(o.evictions is not None for o in outs)
    for out, oracle in zip(outs, oracles):
        if out.evictions is None:
            assert oracle is None
            continue
        assert torch.equal(out.evictions.starts, oracle.starts)
        n_layers, n_heads = TINY["num_hidden_layers"], TINY["num_key_value_heads"]
        for layer in range(n_layers):
            for e in range(oracle.starts.numel()):
                mine = out.evictions.kept_by_layer()[min(layer, out.evictions.shape[0] - 1)][e]
                theirs = oracle.kept_by_layer()[min(layer, oracle.shape[0] - 1)][e]
                for h in range(n_heads):
                    assert set(mine[min(h, mine.shape[0] - 1)].tolist()) == set(theirs[min(h, theirs.shape[0] - 1)].tolist())
