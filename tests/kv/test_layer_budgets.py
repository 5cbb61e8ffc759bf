"""Per-layer budgets (slime_sparse.kv.budgets) through the library: the schedule's shape, when a row compresses,
what selection keeps, the eviction record, and the learner's shadow forward.

References written here: PyramidKV's arithmetic sequence as the paper states it (arXiv 2406.02069 section 3.3: the
top layer 1/beta of the mean, the bottom twice the mean minus that, linear in between), a step-by-step simulation
of a row under the trigger rule, python sets of what each layer held, and a budgeted decode loop over a Hugging Face
cache (one DynamicCache layer per model layer, each cut to its own budget) whose log-probs the shadow forward must
reproduce from the record alone.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from slime_sparse.backends.logprobs import response_logprobs
from slime_sparse.kv import (KVCompressConfig, budget_range, compress_indices, layer_budgets, peak_slots, pyramid,
                             row_capacity, score_layer, select_kept, should_compress, trigger)
from slime_sparse.kv.record import EvictionRecord, visible_positions


# ------------------------------------------------------------------------------------------------ the schedules
@pytest.mark.parametrize("mean,layers,beta", [(24, 4, 20), (120, 8, 10), (57, 5, 2), (7, 3, 1), (448, 28, 20)])
def test_pyramid_is_the_papers_arithmetic_sequence(mean, layers, beta):
    budgets = pyramid(mean, layers, beta)
    top, bottom = mean // beta, 2 * mean - mean // beta
    assert (budgets[0], budgets[-1]) == (bottom, top)
    assert sum(budgets) == mean * layers  # the same mean budget as uniform
    step = (bottom - top) / (layers - 1)
    for layer, b in enumerate(budgets):
        assert abs(b - (bottom - layer * step)) <= 0.5 + 1e-9, (layer, b)  # within rounding of the line
    assert list(budgets) == sorted(budgets, reverse=True)


def test_layer_budgets_by_schedule():
    uniform = KVCompressConfig(method="rkv", budget=32, window=4)
    assert layer_budgets(uniform, 3) == (32, 32, 32) and budget_range(uniform) == (32, 32)
    pyr = KVCompressConfig(method="pyramidkv", budget=32, window=4, pyramid_beta=4)  # pyramid: the method's own
    assert pyr.schedule == "pyramid"
    assert layer_budgets(pyr, 4) == tuple(4 + s for s in pyramid(28, 4, 4)) == (53, 39, 25, 11)
    assert budget_range(pyr) == (11, 53) and sum(layer_budgets(pyr, 4)) == 4 * 32
    assert budget_range(pyr) == (min(layer_budgets(pyr, 9)), max(layer_budgets(pyr, 9)))  # any depth
    rkv_pyr = KVCompressConfig(method="rkv", budget=32, window=4, budget_schedule="pyramid", pyramid_beta=4)
    assert layer_budgets(rkv_pyr, 4) == (53, 39, 25, 11)  # any method can take a schedule
    explicit = KVCompressConfig(method="h2o", window=4, budget_schedule="explicit", layer_budgets=(40, 20, 8))
    assert layer_budgets(explicit, 3) == (40, 20, 8) and budget_range(explicit) == (8, 40)
    with pytest.raises(ValueError, match="--kv-layer-budgets lists 3 budgets, the model has 2 layers"):
        layer_budgets(explicit, 2)
    with pytest.raises(ValueError, match="pyramid needs a model of at least 2 layers"):
        layer_budgets(pyr, 1)


def test_kvpress_pyramid_by_hand_and_its_range_at_any_depth():
    """kvpress's rule (the `kvpress` preset), worked by hand from PyramidKVPress.get_layer_budget (test_kvpress_oracle.py
    compares with kvpress itself): the issue's example, 4 layers, n = 400, W = 8, beta 20, B = 200."""
    cfg = KVCompressConfig.from_preset("kvpress", method="pyramidkv", budget=200, window=8)
    # uncapped: min 200 / 20 = 10, max 400 - 10 = 390, steps 380 / 3; at n = 400 the cap (392) does not bind
    assert layer_budgets(cfg, 4) == layer_budgets(cfg, 4, [400] * 4) == (390, 263, 137, 10)
    # n = 300: capped at 292, bottom 400 - 292 = 108; n = 205: capped at 197, below its bottom 203: B everywhere
    assert layer_budgets(cfg, 4, [300] * 4) == (292, 231, 169, 108)
    assert layer_budgets(cfg, 4, [205] * 4) == (200,) * 4
    # kvpress's defaults (window 64, beta 20) at B = 150: the bottom 7.5 < 64, every layer keeps B
    assert layer_budgets(KVCompressConfig.from_preset("kvpress", method="pyramidkv", budget=150), 4) == (150,) * 4
    assert KVCompressConfig(method="pyramidkv", budget=200, window=8, pyramid_beta=20.0).preset == "custom"
    for budget, window, beta in [(200, 8, 20.0), (57, 3, 2.0), (75, 8, 2.0), (150, 64, 20.0), (33, 4, 7.0)]:
        cfg = KVCompressConfig.from_preset("kvpress", method="pyramidkv", budget=budget, window=window,
                                           pyramid_beta=beta)
        low, high = budget_range(cfg)
        for layers in range(2, 65):
            budgets = layer_budgets(cfg, layers)
            assert max(budgets) == high and 0 <= min(budgets) - low <= 1, (budget, layers, budgets)
            assert list(budgets) == sorted(budgets, reverse=True) and min(budgets) >= window


def test_which_slots_are_protected_is_the_presets():
    """kvpress's KeyDiff and StreamingLLM protect no recent slots; every other method, and those two under any
    other preset, keep the last `window` (which still sizes the query ring)."""
    kvpress = {m: KVCompressConfig.from_preset("kvpress", method=m, budget=80) for m in ("keydiff", "streaming",
                                                                                        "snapkv", "pyramidkv")}
    assert [c.protected_window for c in kvpress.values()] == [0, 0, 64, 64]
    assert KVCompressConfig(method="keydiff", budget=80).protected_window == 8
    assert KVCompressConfig(method="streaming", budget=80).protected_window == 8
    # no protected window: a budget below the window is fine (StreamingLLM: above the 4 sinks)
    assert KVCompressConfig.from_preset("kvpress", method="streaming", budget=5).budget == 5
    with pytest.raises(ValueError, match="--kv-budget=4 is invalid"):
        KVCompressConfig.from_preset("kvpress", method="streaming", budget=4)
    scores = torch.arange(10.0).flip(0)[None]  # the oldest slots score highest
    kept = select_kept(scores, 3, kvpress["keydiff"])
    assert kept.tolist() == [[0, 1, 2]]  # nothing kept for being recent
    assert select_kept(scores, 3, KVCompressConfig(method="keydiff", budget=3, window=2)).tolist() == [[0, 8, 9]]


@pytest.mark.parametrize("kwargs,flag", [
    (dict(budget_schedule="explicit"), "--kv-layer-budgets"),
    (dict(layer_budgets=(20, 10)), "--kv-layer-budgets"),
    (dict(budget_schedule="explicit", layer_budgets=(20, 3)), "--kv-layer-budgets"),
    (dict(budget_schedule="cone"), "--kv-budget-schedule"),
    (dict(budget_schedule="pyramid", pyramid_beta=0.5), "--kv-pyramid-beta"),
])
def test_bad_schedules_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        KVCompressConfig(method="rkv", budget=16, window=4, **kwargs).validate()


def simulated_row(prompt: int, decode_steps: int, budgets: tuple[int, ...], buffer: int, after_prefill: bool):
    """Slots of every layer after each step: all layers compress together when the fullest reaches
    max(B) + buffer (and, for prefill methods, right after the prompt if it exceeds the smallest budget), layer l
    keeping min(its slots, B_l); one slot per layer per decode step."""
    fills = [prompt] * len(budgets)
    history = []
    for step in range(decode_steps):
        due = max(fills) >= max(budgets) + buffer or (after_prefill and step == 0 and prompt > min(budgets))
        if due:
            fills = [min(f, b) for f, b in zip(fills, budgets)]
        fills = [f + 1 for f in fills]
        history.append((due, list(fills)))
    return history


@pytest.mark.parametrize("method", ["rkv", "pyramidkv"])
@pytest.mark.parametrize("prompt", [3, 12, 30, 70])
def test_schedule_for_per_layer_budgets_equals_a_simulation(method, prompt):
    cfg = KVCompressConfig(method=method, budget=20, buffer=6, window=2, budget_schedule="pyramid", pyramid_beta=3)
    budgets = layer_budgets(cfg, 4)
    history = simulated_row(prompt, 80, budgets, cfg.buffer, cfg.traits.compresses_after_prefill)
    fullest = prompt
    for step, (due, fills) in enumerate(history):
        assert should_compress(fullest, cfg, first_decode=step == 0) == due, (step, fullest)
        for layer, b in enumerate(budgets):
            assert peak_slots(prompt, step + 1, cfg, first_decode=True, budget=b) == max(
                [prompt] + [f[layer] for _, f in history[: step + 1]]), (step, layer)
        fullest = max(fills)
    settled = [fills for due, fills in history[-cfg.buffer * 2:]]
    for layer, b in enumerate(budgets):  # in the end, layer l cycles in (B_l, B_l + buffer]
        assert all(b < f[layer] <= b + cfg.buffer for f in settled), layer
    assert max(max(f) for _, f in history) <= max(prompt, trigger(cfg))  # the row never needs more
    assert trigger(cfg) == max(budgets) + cfg.buffer == row_capacity(cfg, 10_000)


# ----------------------------------------------------------------------------------------------- selection
def random_layers(seed: int, layers: int, n: int, n_kv: int = 2, group: int = 2, w: int = 3, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n_kv, n, d, generator=g) for _ in range(layers)]
    queries = [torch.randn(n_kv * group, w, d, generator=g) for _ in range(layers)]
    return keys, queries


def test_model_granularity_needs_one_budget():
    with pytest.raises(ValueError, match="--kv-granularity='model' is invalid: model needs one budget"):
        KVCompressConfig(method="rkv", budget=10, window=3, granularity="model", budget_schedule="pyramid").validate()


@pytest.mark.parametrize("granularity", ["head", "layer"])
def test_selection_under_per_layer_budgets_is_each_layer_alone(granularity):
    cfg = KVCompressConfig(method="snapkv", budget=10, window=3, kernel_size=3, granularity=granularity,
                           budget_schedule="explicit", layer_budgets=(16, 10, 6))
    keys, queries = random_layers(0, 3, 24)
    kept = compress_indices(cfg, keys, queries)
    assert [k.shape for k in kept] == [(2, 16), (2, 10), (2, 6)]
    uniform = dataclasses.replace(cfg, budget_schedule=None, layer_budgets=())
    for layer, b in enumerate((16, 10, 6)):  # layer l keeps what a uniform run at B_l keeps in that layer
        alone = compress_indices(uniform, keys, queries, budget=b)[layer]
        assert torch.equal(kept[layer], alone)


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "rkv", "h2o", "streaming", "keydiff"])
def test_scores_broadcast_over_leading_dims(method):
    """[rows, layers, Hkv, n, d] at once = each entry alone (what a batched engine step would call)."""
    cfg = KVCompressConfig(method=method, budget=10, window=3, kernel_size=3, n_sink=1)
    g = torch.Generator().manual_seed(1)
    keys, queries = torch.randn(3, 2, 2, 20, 8, generator=g), torch.randn(3, 2, 4, 3, 8, generator=g)
    mass = torch.rand(3, 2, 2, 20, generator=g) if method == "h2o" else None
    batched = score_layer(cfg, keys, queries, attn_mass=mass)
    assert batched.shape == (3, 2, 2, 20)
    for r in range(3):
        for layer in range(2):
            alone = score_layer(cfg, keys[r, layer], queries[r, layer],
                                attn_mass=None if mass is None else mass[r, layer])
            torch.testing.assert_close(batched[r, layer], alone, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the record
def test_record_round_trip_with_per_layer_budgets_and_the_mask_is_what_each_layer_held():
    """Events chosen by compress_indices under a pyramid; python sets say what each layer and head held when each
    token ran; the record's mask must say the same, layer by layer."""
    cfg = KVCompressConfig(method="keydiff", budget=10, buffer=4, window=2, budget_schedule="pyramid", pyramid_beta=4)
    budgets = layer_budgets(cfg, 3)
    assert len(set(budgets)) == 3
    g = torch.Generator().manual_seed(0)
    held = [[list(range(0)) for _ in range(2)] for _ in range(3)]  # [layer][head] positions held
    seen: dict[int, list[list[set]]] = {}  # query position -> [layer][head] visible set
    events, total = [], 45
    for q in range(total):
        fullest = max(len(h[0]) for h in held)
        if should_compress(fullest, cfg, first_decode=q == 12):  # a prefill method would cut a 12-token prompt
            keys = [torch.randn(2, len(held[layer][0]), 8, generator=g) for layer in range(3)]
            kept_slots = compress_indices(cfg, keys, [torch.zeros(4, 0, 8)] * 3)
            kept = [torch.tensor([[held[layer][h][s] for s in kept_slots[layer][h].tolist()] for h in range(2)])
                    for layer in range(3)]
            events.append((q, kept))
            held = [[sorted(k[h].tolist()) for h in range(2)] for k in kept]
        held = [[h + [q] for h in layer] for layer in held]
        seen[q] = [[set(h) for h in layer] for layer in held]
    record = EvictionRecord.from_events(events)
    assert record.budgets == budgets and record.shape == (3, 2, max(budgets))
    decoded = record.kept_by_layer()
    for layer in range(3):
        assert decoded[layer].shape == (len(events), 2, budgets[layer])
        for e, (_, k) in enumerate(events):
            assert torch.equal(decoded[layer][e], k[layer].sort(dim=-1).values)
        mask = visible_positions(record, total, layer)
        for q in range(total):
            for h in range(2):
                assert set(torch.nonzero(mask[h, q]).flatten().tolist()) == seen[q][layer][h], (layer, q, h)
    with pytest.raises(ValueError, match="kept_by_layer"):
        record.kept_positions()
    record.check(3, 2, total)
    with pytest.raises(ValueError, match="3 layers x 2 KV heads"):
        record.check(4, 2, total)


def test_uniform_records_keep_their_layout():
    """Under one budget the bits are laid out as before per-layer budgets ([L', H', |H_e|] per compression): a
    record written then decodes the same now."""
    kept0 = torch.tensor([[[0, 2, 5], [1, 2, 5]], [[0, 3, 5], [0, 4, 5]]])  # 2 layers x 2 heads, B 3, after 6
    kept1 = torch.tensor([[[0, 6, 8], [2, 5, 8]], [[3, 7, 8], [0, 6, 8]]])  # after 9 more
    record = EvictionRecord.from_events([(6, kept0), (9, kept1)])
    held0 = torch.arange(6).expand(2, 2, -1)
    held1 = torch.cat([kept0, torch.arange(6, 9).expand(2, 2, -1)], dim=-1)
    bits = torch.cat([(held0[..., :, None] == kept0[..., None, :]).any(-1).flatten(),
                      (held1[..., :, None] == kept1[..., None, :]).any(-1).flatten()])
    from slime_sparse.kv.record import pack_bits

    assert record.budgets is None and record.shape == (2, 2, 3)
    assert torch.equal(record.keep_bits, pack_bits(bits))
    assert torch.equal(record.kept_positions(), torch.stack([kept0, kept1]))
    legacy = EvictionRecord(starts=record.starts, keep_bits=record.keep_bits, shape=(2, 2, 3))  # no budgets field
    assert torch.equal(legacy.kept_positions(), record.kept_positions())


# ------------------------------------------------------------------------------- shadow forward, exactly
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def budgeted_decode(model, prompt: list[int], steps: int, cfg: KVCompressConfig, temperature: float, seed: int):
    """A reference sampler: token by token through a Hugging Face DynamicCache, each layer's cache cut to its own
    budget by the kv library when the schedule says so; positions stay logical. Returns the response, the sampler's
    log-probs and the eviction events (tokens run before each compression, positions kept per layer)."""
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    n_layers = model.config.num_hidden_layers
    held = [torch.arange(0).expand(model.config.num_key_value_heads, -1) for _ in range(n_layers)]
    tokens, logprobs, events = list(prompt), [], []
    for pos in range(len(prompt) + steps - 1):
        with torch.no_grad():
            logits = model(torch.tensor([[tokens[pos]]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[pos]])).logits[0, -1]
        held = [torch.cat([h, torch.full((h.shape[0], 1), pos)], dim=-1) for h in held]
        if pos >= len(prompt) - 1:  # sample the next token
            logp = torch.log_softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=g))
            tokens.append(token)
            logprobs.append(float(logp[token]))
        fullest = max(h.shape[-1] for h in held)
        if should_compress(fullest, cfg, first_decode=pos == len(prompt) - 1):
            keys = [cache.layers[layer].keys[0] for layer in range(n_layers)]
            kept = compress_indices(cfg, keys, [torch.zeros(4, 0, keys[0].shape[-1])] * n_layers)
            for layer, slots in enumerate(kept):  # each head keeps its own slots
                index = slots[None, :, :, None].expand(1, -1, -1, keys[0].shape[-1])
                cache.layers[layer].keys = cache.layers[layer].keys.gather(2, index)
                cache.layers[layer].values = cache.layers[layer].values.gather(2, index)
                held[layer] = held[layer].gather(-1, slots)
            events.append((pos + 1, [h.clone() for h in held]))
    return tokens[len(prompt):], logprobs, events


@pytest.mark.parametrize("granularity", ["head", "layer"])
def test_shadow_forward_reproduces_a_pyramid_sampler_exactly(granularity):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    cfg = KVCompressConfig(method="keydiff", budget=8, buffer=3, window=2, budget_schedule="pyramid", pyramid_beta=3,
                           granularity=granularity)
    assert layer_budgets(cfg, 3) == (12, 8, 4)
    prompts = [list(range(10, 19)), [5, 17, 3], list(range(30, 50))]
    records, tokens, lens, sampler = [], [], [], []
    for i, prompt in enumerate(prompts):
        response, logprobs, events = budgeted_decode(model, prompt, 24, cfg, temperature=0.9, seed=i)
        records.append(EvictionRecord.from_events(events))
        assert records[-1].budgets == (12, 8, 4) and records[-1].starts.numel() >= 3
        tokens.append(prompt + response)
        lens.append(len(response))
        sampler.append(torch.tensor(logprobs))
    sampler = torch.nn.utils.rnn.pad_sequence(sampler, batch_first=True)
    with torch.no_grad():
        shadow, _ = response_logprobs(model, tokens, lens, temperature=0.9, shadow=records)
        dense, _ = response_logprobs(model, tokens, lens, temperature=0.9)
    assert (shadow - sampler).abs().max() < 1e-5
    assert (dense - sampler).abs().max() > 1e-2  # the per-layer cuts did change what the sampler saw


def test_the_reference_sampler_is_dense_without_compression():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    cfg = KVCompressConfig(method="keydiff", budget=100, buffer=3, window=2)
    prompt = list(range(10, 19))
    response, logprobs, events = budgeted_decode(model, prompt, 12, cfg, temperature=0.9, seed=0)
    assert events == []
    with torch.no_grad():
        dense, _ = response_logprobs(model, [prompt + response], [len(response)], temperature=0.9)
    assert (dense[0] - torch.tensor(logprobs)).abs().max() < 1e-5


@pytest.mark.parametrize("granularity", ["head", "layer"])
@pytest.mark.parametrize("method", ["rkv", "keydiff"])
def test_batched_rows_select_what_each_row_selects_alone(method, granularity):
    """What a [rows, layers, Hkv, slots] engine calls: compress_indices over all rows of each layer at once under
    per-layer budgets; row r keeps what it keeps alone."""
    cfg = KVCompressConfig(method=method, budget=10, window=3, kernel_size=3, granularity=granularity,
                           budget_schedule="explicit", layer_budgets=(14, 10, 5))
    g = torch.Generator().manual_seed(2)
    keys = [torch.randn(4, 2, n, 8, generator=g) for n in (22, 19, 16)]  # layers hold different slot counts
    queries = [torch.randn(4, 4, 3, 8, generator=g) for _ in range(3)]
    kept = compress_indices(cfg, keys, queries)
    assert [k.shape for k in kept] == [(4, 2, 14), (4, 2, 10), (4, 2, 5)]
    for r in range(4):
        alone = compress_indices(cfg, [k[r] for k in keys], [q[r] for q in queries])
        assert all(torch.equal(k[r], a) for k, a in zip(kept, alone)), r


def test_one_budget_for_a_per_layer_schedule_is_refused():
    """An engine that still passes one budget per row (today's embedded engine) cannot run a pyramid by accident."""
    cfg = KVCompressConfig(method="pyramidkv", budget=10, window=3, kernel_size=3)
    keys, queries = random_layers(0, 3, 24)
    with pytest.raises(ValueError, match="--kv-budget-schedule=pyramid"):
        compress_indices(cfg, keys, queries, budget=10)
    assert [k.shape[-1] for k in compress_indices(cfg, keys, queries)] == list(layer_budgets(cfg, 3))
