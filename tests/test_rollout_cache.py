"""Building blocks of the embedded engine: step plans, the budgeted cache, grouped attention."""
import torch

from slime_sparse.rollout.embedded.attention import grouped_attention
from slime_sparse.rollout.embedded.cache import BudgetKVCache
from slime_sparse.rollout.embedded.plan import build_plan, decode_plan

L, HKV, HQ, D, CAP, WIN = 2, 2, 4, 4, 10, 3


def make_cache(rows: int = 3, track_mass: bool = True) -> BudgetKVCache:
    return BudgetKVCache(num_layers=L, num_rows=rows, num_kv_heads=HKV, num_q_heads=HQ, head_dim=D, capacity=CAP,
                         window=WIN, record_queries=True, track_mass=track_mass, device=torch.device("cpu"),
                         dtype=torch.float32)


def run_plan(cache: BudgetKVCache, plan, chunk_lengths, seed: int = 0):
    """Feed random keys/values/queries for the plan's columns through every layer, as the model would."""
    g = torch.Generator().manual_seed(seed)
    n, width = plan.input_ids.shape
    ks, vs, qs = [], [], []
    for layer in range(L):
        k, v = torch.randn(n, HKV, width, D, generator=g), torch.randn(n, HKV, width, D, generator=g)
        q = torch.randn(n, HQ, width, D, generator=g)
        cache.update(k, v, layer)
        cache.record_queries(layer, q)
        ks.append(k), vs.append(v), qs.append(q)
    cache.commit(chunk_lengths)
    return ks, vs, qs


def test_plan_left_pads_and_masks_by_hand():
    # row 0 holds 3 slots and appends 2 tokens at positions 7, 8; row 1 is new with a 3-token prompt
    plan = build_plan(row_start=1, chunks=[[11, 12], [21, 22, 23]], fills=[3, 0], first_positions=[7, 0],
                      queries_seen=[5, 0], window=2, device=torch.device("cpu"))
    assert plan.input_ids.tolist() == [[0, 11, 12], [21, 22, 23]]
    assert plan.position_ids.tolist() == [[0, 7, 8], [0, 1, 2]]
    assert plan.span == 5
    limits = [[5, 4, 5], [1, 2, 3]]  # padding column sees the whole row; real token i sees fill + i + 1 slots
    expected = torch.tensor([[[s < lim for s in range(5)] for lim in row] for row in limits])
    assert torch.equal(plan.attn_mask[:, 0], expected)
    assert plan.write_row.tolist() == [1, 1, 2, 2, 2]
    assert plan.write_slot.tolist() == [3, 4, 0, 1, 2]
    assert plan.write_pos.tolist() == [7, 8, 0, 1, 2]
    # last `window` = 2 real queries per row go to ring slots (seen + i) % 2
    assert list(zip(plan.ring_row.tolist(), plan.ring_slot.tolist())) == [(1, 1), (1, 0), (2, 1), (2, 0)]
    assert plan.query_valid.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_decode_plan_equals_the_general_plan_of_one_token_chunks():
    tokens, fills, positions, seen = [5, 6, 7], [3, 9, 1], [10, 40, 1], [10, 40, 2]
    fast = decode_plan(tokens, fills, positions, seen, window=4, device=torch.device("cpu"))
    general = build_plan(0, [[t] for t in tokens], fills, positions, seen, window=4, device=torch.device("cpu"))
    assert fast.decode and not general.decode and fast.span == general.span == 10
    for name in ("input_ids", "position_ids", "attn_mask", "write_row", "write_slot", "write_pos", "ring_row",
                 "ring_slot", "query_valid"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    for a, b in zip(fast.write_src + fast.ring_src, general.write_src + general.ring_src):
        assert torch.equal(a, b)


def test_update_writes_real_tokens_and_returns_views():
    cache = make_cache()
    cache.fill[1] = 3
    plan = build_plan(1, [[11, 12], [21, 22, 23]], [3, 0], [7, 0], [0, 0], WIN, torch.device("cpu"))
    cache.begin(plan)
    k = torch.randn(2, HKV, 3, D)
    v = torch.randn(2, HKV, 3, D)
    keys, values = cache.update(k, v, layer_idx=1)
    assert keys.shape == (2, HKV, 5, D)
    assert keys.data_ptr() == cache.key[1, 1].data_ptr()  # a view, not a copy
    assert torch.equal(cache.key[1, 1, :, 3:5], k[0, :, 1:3])  # column 0 of row 0 is padding: not written
    assert torch.equal(cache.value[1, 2, :, 0:3], v[1])
    assert cache.positions[1, 1, :, 3:5].tolist() == [[7, 8]] * HKV
    assert cache.key[0].abs().sum() == 0  # other layers untouched


def test_compact_keeps_selected_slots_per_head_and_layer():
    cache = make_cache()
    plan = build_plan(0, [list(range(8))], [0], [0], [0], WIN, torch.device("cpu"))
    cache.begin(plan)
    ks, vs, _ = run_plan(cache, plan, [8])
    cache.mass[:, 0, :, :8] = torch.arange(8.0)
    kept = [torch.tensor([[0, 2, 5, 7], [1, 2, 6, 7]]), torch.tensor([[3, 4, 5, 7], [0, 1, 2, 7]])]
    cache.compact(0, kept)
    assert cache.fill[0] == 4
    for layer in range(L):
        for h in range(HKV):
            idx = kept[layer][h]
            assert torch.equal(cache.key[layer, 0, h, :4], ks[layer][0, h, idx])
            assert torch.equal(cache.value[layer, 0, h, :4], vs[layer][0, h, idx])
            assert cache.positions[layer, 0, h, :4].tolist() == idx.tolist()  # logical positions follow the slots
            assert cache.mass[layer, 0, h, :4].tolist() == idx.float().tolist()
    assert cache.held_positions(0)[1, 0].tolist() == [3, 4, 5, 7]


def test_window_queries_are_the_last_in_order_after_wraparound():
    cache = make_cache(rows=1)
    all_q = []
    for step, chunk in enumerate([[1, 2, 3, 4, 5], [6], [7]]):  # 7 queries through a ring of 3
        fill, seen = cache.fill[0], cache.queries_seen[0]
        plan = build_plan(0, [chunk], [fill], [fill], [seen], WIN, torch.device("cpu"))
        cache.begin(plan)
        _, _, qs = run_plan(cache, plan, [len(chunk)], seed=step)
        all_q.append(torch.stack(qs)[:, 0])  # [L, HQ, C, D]
    history = torch.cat(all_q, dim=2)  # [L, HQ, 7, D]
    got = cache.window_queries(0)
    for layer in range(L):
        assert torch.equal(got[layer], history[layer, :, -WIN:])


def test_copy_row_copies_all_state():
    cache = make_cache()
    plan = build_plan(0, [[1, 2, 3, 4], [5, 6]], [0, 0], [0, 0], [0, 0], WIN, torch.device("cpu"))
    cache.begin(plan)
    run_plan(cache, plan, [4, 2])
    cache.mass[:, 1] = torch.rand(L, HKV, CAP)
    before = {name: getattr(cache, name)[:, 1].clone() for name in ("key", "value", "positions", "mass", "queries")}
    cache.copy_row(src=1, dst=0)
    assert cache.fill[0] == 2 and cache.queries_seen[0] == 2
    for name in ("key", "value", "positions", "mass"):
        assert torch.equal(getattr(cache, name)[:, 0, :, :2], before[name][:, :, :2]), name
    assert torch.equal(cache.queries[:, 0], before["queries"])
    assert torch.equal(cache.window_queries(0)[0], before["queries"][0][:, :2])


def test_grouped_attention_matches_repeat_kv_reference_and_accumulates_mass():
    torch.manual_seed(0)
    n, width, span = 2, 3, 6
    q, k, v = torch.randn(n, HQ, width, D), torch.randn(n, HKV, span, D), torch.randn(n, HKV, span, D)
    mask = torch.rand(n, 1, width, span) > 0.3
    mask[..., 0] = True
    out, probs = grouped_attention(q, k, v, mask, scaling=0.5)
    rk, rv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # query head h uses KV head h // 2
    ref_p = torch.softmax((q @ rk.transpose(-1, -2) * 0.5).masked_fill(~mask, float("-inf")), dim=-1)
    assert torch.allclose(out, (ref_p @ rv).transpose(1, 2), atol=1e-6)
    assert torch.allclose(probs.reshape(n, HQ, width, span), ref_p, atol=1e-6)

    cache = make_cache(rows=2)
    cache.fill[:] = [3, 3]
    plan = build_plan(0, [[1, 2, 3], [4]], [3, 3], [3, 3], [3, 3], WIN, torch.device("cpu"))
    cache.begin(plan)
    cache.accumulate_mass(0, torch.ones(2, HKV, 2, 3, plan.span))
    # row 0: 3 real queries x 2 heads of the group; row 1: one real query (2 padding columns do not count)
    assert cache.mass[0, 0, :, : plan.span].unique().tolist() == [6.0]
    assert cache.mass[0, 1, :, : plan.span].unique().tolist() == [2.0]
