"""Building blocks of the embedded engine: prefill plans, the budgeted cache, grouped and decode attention."""
import torch

from slime_sparse.rollout.embedded.attention import decode_attention, grouped_attention
from slime_sparse.rollout.embedded.cache import BudgetKVCache, DecodeView
from slime_sparse.rollout.embedded.plan import build_plan
from slime_sparse.rollout.embedded.table import RowTable

L, HKV, HQ, D, CAP, WIN = 2, 2, 4, 4, 10, 3
CPU = torch.device("cpu")


def make_cache(rows: int = 3, track_mass: bool = True) -> BudgetKVCache:
    return BudgetKVCache(num_rows=rows, num_layers=L, num_kv_heads=HKV, num_q_heads=HQ, head_dim=D, capacity=CAP,
                         window=WIN, record_queries=True, track_mass=track_mass, device=CPU, dtype=torch.float32)


def prefill(cache: BudgetKVCache, row_start: int, chunks, first_positions, seed: int = 0):
    """Plan and run a prefill with random keys/values/queries through every layer, as the model would."""
    rows = slice(row_start, row_start + len(chunks))
    plan = build_plan(row_start, chunks, cache.fill[:, rows].tolist(), first_positions, WIN, CPU)
    g = torch.Generator().manual_seed(seed)
    n, width = plan.input_ids.shape
    cache.begin(plan)
    ks, vs, qs = [], [], []
    for layer in range(L):
        k, v = torch.randn(n, HKV, width, D, generator=g), torch.randn(n, HKV, width, D, generator=g)
        q = torch.randn(n, HQ, width, D, generator=g)
        cache.update(k, v, layer)
        cache.record_queries(layer, q)
        ks.append(k), vs.append(v), qs.append(q)
    cache.end_prefill()
    return plan, ks, vs, qs


def test_plan_left_pads_and_is_relative_to_each_layers_fill():
    # row 0 holds 3 slots in layer 0 and 5 in layer 1, and appends 2 tokens at positions 7, 8; row 1 is new
    plan = build_plan(row_start=1, chunks=[[11, 12], [21, 22, 23]], fills=[[3, 0], [5, 0]], first_positions=[7, 0],
                      window=2, device=CPU)
    assert plan.input_ids.tolist() == [[0, 11, 12], [21, 22, 23]]
    assert plan.position_ids.tolist() == [[0, 7, 8], [0, 1, 2]]
    assert plan.spans == (5, 7)
    assert plan.limit.tolist() == [[2, 1, 2], [1, 2, 3]]  # padding sees the whole chunk; real token i sees i + 1
    assert plan.write_row.tolist() == [1, 1, 2, 2, 2]
    assert plan.write_offset.tolist() == [0, 1, 0, 1, 2]
    assert plan.write_pos.tolist() == [7, 8, 0, 1, 2]
    # the last `window` = 2 real queries of each row, with their index relative to the queries seen before
    assert list(zip(plan.ring_row.tolist(), plan.ring_offset.tolist())) == [(1, 0), (1, 1), (2, 1), (2, 2)]
    assert plan.query_valid.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_prefill_writes_real_tokens_after_each_layers_fill_and_masks_by_hand():
    cache = make_cache()
    cache.fill[:, 1] = torch.tensor([3, 5])
    cache.shared_fill = False  # the layers hold different fills here
    plan = build_plan(1, [[11, 12], [21, 22, 23]], cache.fill[:, 1:3].tolist(), [7, 0], WIN, CPU)
    cache.begin(plan)
    k, v = torch.randn(2, HKV, 3, D), torch.randn(2, HKV, 3, D)
    keys, values = cache.update(k, v, layer_idx=1)
    assert keys.shape == (2, HKV, 7, D)
    assert keys.data_ptr() == cache.key[1][1].data_ptr()  # a view, not a copy
    assert torch.equal(cache.key[1][1, :, 5:7], k[0, :, 1:3])  # column 0 of row 0 is padding: not written
    assert torch.equal(cache.value[1][2, :, 0:3], v[1])
    assert cache.positions[1][1, :, 5:7].tolist() == [[7, 8]] * HKV
    assert cache.key[0].abs().sum() == 0  # other layers untouched
    # layer 1: row 0 sees its 5 old slots plus new tokens 0..i; its padding column sees 5 + 2
    expected = [[[s < lim for s in range(7)] for lim in row] for row in ([7, 6, 7], [1, 2, 3])]
    assert cache.attention_mask(1)[:, 0].tolist() == expected
    cache.end_prefill()
    assert cache.fill.tolist() == [[0, 5, 3], [0, 7, 3]]


def test_decode_writes_at_the_fill_and_parked_rows_write_only_their_last_slot():
    cache = make_cache(rows=3)
    prefill(cache, 0, [[1, 2, 3], [4, 5]], [0, 0])
    cache.park_row(2)
    table = RowTable.allocate(L, 3, 4)
    table.fill[:] = cache.fill.numpy()
    before = [k.clone() for k in cache.key]
    positions = torch.tensor([3, 2, 99])
    cache.begin(DecodeView(3, table.spans(3, 1, CAP), positions))
    assert table.spans(3, 1, CAP) == (CAP, CAP)  # the parked row "holds" the whole capacity
    assert table.spans(2, 1, CAP) == (4, 4) and table.spans(2, 8, CAP) == (8, 8)
    k = torch.randn(3, HKV, 1, D)
    cache.update(k, torch.randn(3, HKV, 1, D), 0)
    assert torch.equal(cache.key[0][0, :, 3], k[0, :, 0]) and torch.equal(cache.key[0][1, :, 2], k[1, :, 0])
    assert torch.equal(cache.key[0][2, :, CAP - 1], k[2, :, 0])  # its own last slot
    assert torch.equal(cache.key[0][2, :, : CAP - 1], before[0][2, :, : CAP - 1])
    assert cache.positions[0][:, 0, [3, 2, CAP - 1]].diagonal().tolist() == [3, 2, 99]
    mask = cache.attention_mask(0)[:, 0, 0]  # the new token at slot fill sees [0, fill]
    assert mask.sum(-1).tolist() == [4, 3, CAP]
    cache.end_decode()
    assert cache.fill.tolist() == [[4, 3, CAP]] * L
    assert cache.seen.tolist() == [4, 3, 1]


def test_compact_keeps_selected_slots_per_row_head_and_layer():
    cache = make_cache()
    _, ks, vs, _ = prefill(cache, 0, [list(range(8)), list(range(10, 18))], [0, 0])
    for layer in range(L):
        cache.mass[layer][:2, :, :8] = torch.arange(8.0)
    kept = [torch.tensor([[[0, 2, 5, 7], [1, 2, 6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]]),
            torch.tensor([[[3, 4, 5, 7], [0, 1, 2, 7]], [[1, 3, 5, 7], [0, 2, 4, 6]]])]  # [R'=2, Hkv, 4] per layer
    cache.compact(torch.arange(L), torch.tensor([0, 1]), torch.stack(kept), torch.tensor([4, 4]))
    assert cache.fill.tolist() == [[4, 4, 0]] * L
    for layer in range(L):
        for row in range(2):
            for h in range(HKV):
                idx = kept[layer][row, h]
                assert torch.equal(cache.key[layer][row, h, :4], ks[layer][row, h, idx])
                assert torch.equal(cache.value[layer][row, h, :4], vs[layer][row, h, idx])
                assert cache.positions[layer][row, h, :4].tolist() == idx.tolist()  # positions follow the slots
                assert cache.mass[layer][row, h, :4].tolist() == idx.float().tolist()
    assert cache.held_positions(1, [4, 4])[1][0].tolist() == [1, 3, 5, 7]


def test_compact_broadcasts_a_set_shared_by_heads_and_layers():
    cache = make_cache()
    _, ks, _, _ = prefill(cache, 0, [list(range(8)), list(range(10, 18))], [0, 0])
    kept = torch.tensor([[[[1, 4, 6]], [[0, 2, 7]]]])  # [L'=1, R'=2, H'=1, 3]: one set per row for every head and layer
    cache.compact(torch.arange(L), torch.tensor([1, 0]), kept, torch.tensor([3, 3]))  # rows in another order
    for layer in range(L):
        for row, idx in ((1, [1, 4, 6]), (0, [0, 2, 7])):
            for h in range(HKV):
                assert torch.equal(cache.key[layer][row, h, :3], ks[layer][row, h, idx])
    assert cache.fill.tolist() == [[3, 3, 0]] * L


def test_window_queries_are_the_last_in_order_after_wraparound():
    cache = make_cache(rows=2)
    history = []
    for step, chunk in enumerate([[1, 2, 3, 4, 5], [6], [7]]):  # 7 queries through a ring of 3
        _, _, _, qs = prefill(cache, 0, [chunk, chunk[:1]], [int(cache.fill[0, 0])] * 2, seed=step)
        history.append(torch.stack(qs)[:, 0])  # [L, HQ, C, D] of row 0
    history = torch.cat(history, dim=2)  # [L, HQ, 7, D]
    layers = torch.arange(L)
    got = cache.window_queries(layers, torch.zeros(L, dtype=torch.long), WIN)  # entries (layer l, row 0): [L, HQ, m, D]
    assert torch.equal(got, history[:, :, -WIN:])
    assert cache.window_queries(torch.tensor([1]), torch.tensor([1]), 2).shape == (1, HQ, 2, D)
    assert torch.equal(cache.window_queries(torch.tensor([1]), torch.tensor([0]), WIN)[0], history[1, :, -WIN:])


def test_copy_row_copies_all_state():
    cache = make_cache()
    prefill(cache, 0, [[1, 2, 3, 4], [5, 6]], [0, 0])
    cache.mass[0][1] = torch.rand(HKV, CAP)
    before = {name: getattr(cache, name)[0][1].clone() for name in ("key", "value", "positions", "mass", "queries")}
    cache.copy_row(src=1, dst=0, held=2)
    assert cache.fill[:, 0].tolist() == [2, 2]
    assert int(cache.seen[0]) == 2
    for name in ("key", "value", "positions", "mass"):
        assert torch.equal(getattr(cache, name)[0][0, :, :2], before[name][:, :2]), name
    assert torch.equal(cache.queries[0][0], before["queries"])


def test_kv_bytes_and_parked_rows():
    cache = make_cache()
    assert cache.kv_bytes == 2 * L * 3 * HKV * CAP * D * 4
    cache.park_row(0)
    assert cache.fill[:, 0].tolist() == [CAP, CAP]


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
    prefill(cache, 0, [[1, 2, 3], [4, 5, 6]], [0, 0])
    plan = build_plan(0, [[1, 2, 3], [4]], cache.fill[:, :2].tolist(), [3, 3], WIN, CPU)
    cache.begin(plan)
    cache.mass[0].zero_()
    cache.accumulate_mass(0, torch.ones(2, HKV, 2, 3, plan.spans[0]))
    # row 0: 3 real queries x 2 heads of the group; row 1: one real query (2 padding columns do not count)
    assert cache.mass[0][0, :, : plan.spans[0]].unique().tolist() == [6.0]
    assert cache.mass[0][1, :, : plan.spans[0]].unique().tolist() == [2.0]


def test_decode_attention_equals_repeat_kv_sdpa():
    torch.manual_seed(1)
    n, span = 3, 7
    q, k, v = torch.randn(n, HQ, 1, D), torch.randn(n, HKV, span, D), torch.randn(n, HKV, span, D)
    mask = torch.arange(span)[None, :] <= torch.tensor([2, 6, 0])[:, None]

    class MaskOnly:  # what decode attention reads from the cache under SDPA: the backend and the layer's mask
        decode_backend = "sdpa"

        def attention_mask(self, layer: int) -> torch.Tensor:
            return mask[:, None, None]

    out = decode_attention(q[:, :, 0], k, v, MaskOnly(), 0, 0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=mask[:, None, None], scale=0.5)
    assert out.shape == (n, HQ, D)
    assert torch.allclose(out, ref[:, :, 0], atol=1e-6)
