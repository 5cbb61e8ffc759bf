"""HF <-> Megatron weight mapping: pure tensor checks, no megatron-core, no processes.

The layouts are checked against what the sharded layers must *compute*: a TP-sharded SwiGLU MLP and
GQA attention, evaluated rank by rank from our shards and summed as the row-parallel all-reduce would,
must equal the dense HF formulas.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slime_sparse.backends.megatron import weight_mapping as wm
from slime_sparse.backends.megatron.hf_io import bucketed
from slime_sparse.backends.megatron.model_config import ModelSpec, padded_vocab_size


def qwen2_config(**over) -> dict:
    cfg = dict(model_type="qwen2", vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128,
               rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=True, hidden_act="silu")
    cfg.update(over)
    return cfg


def llama_config(**over) -> dict:
    cfg = dict(model_type="llama", vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-5, rope_theta=5e5,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}, tie_word_embeddings=False, attention_bias=False)
    cfg.update(over)
    return cfg


def test_spec_reads_qwen2_and_llama_configs():
    q = ModelSpec.from_hf_config(qwen2_config())
    assert (q.qkv_bias, q.tie_word_embeddings, q.rope_theta, q.rope_scaling_factor) == (True, True, 1e6, None)
    assert (q.head_dim, q.heads_per_group) == (8, 2)
    ll = ModelSpec.from_hf_config(llama_config())  # old-style rope_theta + rope_scaling fields
    assert (ll.qkv_bias, ll.tie_word_embeddings, ll.rope_theta, ll.rope_scaling_factor) == (False, False, 5e5, 8.0)
    assert (ll.head_dim, ll.num_kv_heads, ll.rms_norm_eps) == (8, 4, 1e-5)


def test_spec_rejects_what_megatron_cannot_represent():
    with pytest.raises(ValueError, match="model_type"):
        ModelSpec.from_hf_config(qwen2_config(model_type="mistral"))
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelSpec.from_hf_config(qwen2_config(use_sliding_window=True))
    with pytest.raises(ValueError, match="rope_type"):
        ModelSpec.from_hf_config(qwen2_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="high_freq_factor"):
        ModelSpec.from_hf_config(llama_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelSpec.from_hf_config(qwen2_config(hidden_act="gelu"))


def test_padded_vocab_is_megatron_rule():
    assert padded_vocab_size(100, 1) == 128
    assert padded_vocab_size(100, 2) == 256
    assert padded_vocab_size(151936, 4) == 152064  # Qwen2.5's vocabulary at TP=4 (ceil to 512)
    assert padded_vocab_size(256, 2) == 256


def test_param_rules_cover_hf_names_once():
    for cfg in (qwen2_config(), llama_config()):
        spec = ModelSpec.from_hf_config(cfg)
        hf_names = [n for r in wm.param_rules(spec) for n in r.hf_names]
        assert len(hf_names) == len(set(hf_names))
        per_layer = 9 + (3 if spec.qkv_bias else 0)  # 2 norms + q,k,v,o + gate,up,down (+ 3 biases)
        expected = spec.num_layers * per_layer + 2 + (0 if spec.tie_word_embeddings else 1)
        assert len(hf_names) == expected
        assert ("lm_head.weight" in hf_names) == (not spec.tie_word_embeddings)


def test_merge_qkv_groups_heads_by_kv_head():
    spec = ModelSpec.from_hf_config(llama_config())  # 8 heads, 4 groups, d=8
    d, hidden = spec.head_dim, spec.hidden_size
    # Row r of head h is filled with an id, so the layout can be read back row by row.
    q = torch.arange(spec.num_heads).repeat_interleave(d)[:, None].float().expand(-1, hidden)
    k = 100 + torch.arange(spec.num_kv_heads).repeat_interleave(d)[:, None].float().expand(-1, hidden)
    v = 200 + torch.arange(spec.num_kv_heads).repeat_interleave(d)[:, None].float().expand(-1, hidden)
    merged = wm.merge_qkv(q, k, v, spec)
    expected_ids = []
    for g in range(spec.num_kv_heads):  # group g: its 2 query heads, then key g, then value g
        expected_ids += [2 * g] * d + [2 * g + 1] * d + [100 + g] * d + [200 + g] * d
    assert merged[:, 0].tolist() == expected_ids
    back = wm.split_qkv(merged, spec)
    for a, b in zip(back, (q, k, v)):
        assert torch.equal(a, b)
    bias = [torch.randn(t.shape[0]) for t in (q, k, v)]
    assert all(torch.equal(a, b) for a, b in zip(wm.split_qkv(wm.merge_qkv(*bias, spec), spec), bias))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_swiglu_mlp_equals_dense(tp):
    spec = ModelSpec.from_hf_config(qwen2_config(intermediate_size=64))
    # float64: the test checks the shard layout, not float32 summation order
    gate, up = torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 32, dtype=torch.float64)
    down = torch.randn(32, 64, dtype=torch.float64)
    x = torch.randn(5, 32, dtype=torch.float64)
    dense = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    rules = wm.rules_by_name(spec)
    fc1 = rules["decoder.layers.0.mlp.linear_fc1.weight"]
    fc2 = rules["decoder.layers.0.mlp.linear_fc2.weight"]
    out = torch.zeros_like(dense)
    for r in range(tp):  # Megatron's rank r: split its fc1 output in halves (gate, up), row-parallel fc2
        w1 = wm.hf_to_shard(fc1, [gate, up], spec, 128, r, tp)
        g_r, u_r = torch.chunk(x @ w1.T, 2, dim=-1)
        out += (F.silu(g_r) * u_r) @ wm.hf_to_shard(fc2, [down], spec, 128, r, tp).T
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_gqa_attention_equals_dense(tp):
    spec = ModelSpec.from_hf_config(llama_config(attention_bias=True))
    h, g, d, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    torch.set_default_dtype(torch.float64)  # the test checks the shard layout, not float32 summation order
    try:
        wq, wk, wv = torch.randn(h * d, hidden), torch.randn(g * d, hidden), torch.randn(g * d, hidden)
        bq, bk, bv = torch.randn(h * d), torch.randn(g * d), torch.randn(g * d)
        wo = torch.randn(hidden, h * d)
        x = torch.randn(6, hidden)
    finally:
        torch.set_default_dtype(torch.float32)

    def attend(q, k, v):  # q [heads, S, d], k/v [heads, S, d] already repeated per query head
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    # Dense HF: query head i uses kv head i // (h / g)
    q = (x @ wq.T + bq).view(-1, h, d).transpose(0, 1)
    k = (x @ wk.T + bk).view(-1, g, d).transpose(0, 1).repeat_interleave(h // g, dim=0)
    v = (x @ wv.T + bv).view(-1, g, d).transpose(0, 1).repeat_interleave(h // g, dim=0)
    dense = attend(q, k, v).transpose(0, 1).reshape(-1, h * d) @ wo.T

    rules = wm.rules_by_name(spec)
    qkv_w, qkv_b = rules["decoder.layers.1.self_attention.linear_qkv.weight"], rules["decoder.layers.1.self_attention.linear_qkv.bias"]
    proj = rules["decoder.layers.1.self_attention.linear_proj.weight"]
    out = torch.zeros_like(dense)
    hpg, g_local = h // g, g // tp
    for r in range(tp):  # Megatron's SelfAttention on rank r: its groups, each [hpg queries, key, value]
        w = wm.hf_to_shard(qkv_w, [wq, wk, wv], spec, 128, r, tp)
        b = wm.hf_to_shard(qkv_b, [bq, bk, bv], spec, 128, r, tp)
        mixed = (x @ w.T + b).view(-1, g_local, (hpg + 2) * d)
        qr, kr, vr = torch.split(mixed, [hpg * d, d, d], dim=-1)
        qr = qr.reshape(-1, g_local * hpg, d).transpose(0, 1)
        kr = kr.transpose(0, 1).repeat_interleave(hpg, dim=0)
        vr = vr.transpose(0, 1).repeat_interleave(hpg, dim=0)
        ctx = attend(qr, kr, vr).transpose(0, 1).reshape(x.shape[0], -1)
        out += ctx @ wm.hf_to_shard(proj, [wo], spec, 128, r, tp).T
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip_is_exact(tp):
    spec = ModelSpec.from_hf_config(llama_config())
    padded = padded_vocab_size(spec.vocab_size, tp)
    hf_shapes = {"model.embed_tokens.weight": (100, 32), "lm_head.weight": (100, 32)}
    for rule in wm.param_rules(spec):
        hf = []
        for name in rule.hf_names:
            if name in hf_shapes:
                hf.append(torch.randn(hf_shapes[name]))
            elif "norm" in name:
                hf.append(torch.randn(32))
            elif name.endswith(("q_proj.weight", "o_proj.weight")):
                hf.append(torch.randn(64, 32) if "q_proj" in name else torch.randn(32, 64))
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                hf.append(torch.randn(32, 32))
            else:
                hf.append(torch.randn(48, 32) if "down" not in name else torch.randn(32, 48))
        shards = [wm.hf_to_shard(rule, hf, spec, padded, r, tp) for r in range(tp)]
        if rule.kind == "vocab":
            assert all(s.shape[0] == padded // tp for s in shards)
            assert torch.count_nonzero(torch.cat(shards)[spec.vocab_size:]) == 0  # zero padding rows
        back = wm.full_to_hf_named(rule, wm.unshard(rule, shards), spec)
        assert [n for n, _ in back] == list(rule.hf_names)
        for (_, b), a in zip(back, hf):
            assert torch.equal(a, b), rule.megatron_name


def test_layer_names_offset_by_pipeline_stage():
    assert wm.to_global_name("decoder.layers.1.mlp.linear_fc2.weight", 4) == "decoder.layers.5.mlp.linear_fc2.weight"
    assert wm.to_global_name("embedding.word_embeddings.weight", 4) == "embedding.word_embeddings.weight"
    spec = ModelSpec.from_hf_config(qwen2_config())
    te_rules = wm.rules_by_name(spec, te_fused_norms=True)
    assert te_rules["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"].hf_names == ("model.layers.0.input_layernorm.weight",)
    assert te_rules["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"].hf_names == ("model.layers.1.post_attention_layernorm.weight",)
    assert wm.rules_by_name(spec)["output_layer.weight"].hf_names == ("model.embed_tokens.weight",)  # tied


def test_bucketed_groups_by_bytes_in_order():
    weights = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]  # float32: 4 bytes each
    buckets = list(bucketed(weights, bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucketed(weights, 0))
