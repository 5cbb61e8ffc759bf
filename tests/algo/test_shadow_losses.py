"""--loss-type shadow / smd: the distillation KL, the loss, the learner's gradient against an independent autograd
computation of the stated objective, and the rollout preparation (pi_shadow == pi_sparse, nothing corrected)."""
import copy

import pytest
import torch
from torch.distributions import Categorical, kl_divergence
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM

from slime_sparse.algo import CorrectionConfig, LossConfig, categorical_kl, policy_loss
from slime_sparse.backends.batching import MicroBatching
from slime_sparse.backends.embedded.learner import EmbeddedLearner
from slime_sparse.backends.optimizer import OptimConfig
from slime_sparse.kv import EvictionRecord, KVCompressConfig
from slime_sparse.rollout.pipeline import prepare_rollout, shadow_records
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine, KVTraceRecord
from slime_sparse.types import KVStats, Sample
from slime_sparse.rollout.base_types import RolloutPlan

TEMP = 0.9
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
PROMPTS = [[5, 17, 3, 9, 40, 41], [11, 2, 8], [7, 7, 8, 1, 60, 61, 62, 3, 4, 30, 31, 32, 33]]




# ---- the KL and the loss --------------------------------------------------------------------------------
def test_categorical_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(3, 5, 11, generator=g) * 2, torch.randn(3, 5, 11, generator=g) * 2
    p_logits[0, 0, :4] = float("-inf")  # zero-probability entries of p contribute nothing
    ours = categorical_kl(p_logits.log_softmax(-1), q_logits.log_softmax(-1))
    ref = kl_divergence(Categorical(logits=p_logits), Categorical(logits=q_logits))
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    same = categorical_kl(q_logits.log_softmax(-1), q_logits.log_softmax(-1))
    assert same.abs().max() < 1e-6 and bool((ours > 0).all())


def test_smd_loss_adds_the_aggregated_kl_and_validates():
    g = torch.Generator().manual_seed(1)
    logp, old = -torch.rand(2, 4, generator=g), -torch.rand(2, 4, generator=g)
    adv, mask = torch.tensor([1.0, -0.5]), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    kl = torch.rand(2, 4, generator=g)
    base, _ = policy_loss(logp, old, adv, mask, LossConfig(loss_type="shadow"))
    smd, m = policy_loss(logp, old, adv, mask, LossConfig(loss_type="smd", smd_kl_coef=0.3), distill_kl=kl)
    expected_kl = (kl[0, :3].mean() + kl[1, :2].mean()) / 2  # seq-mean-token-mean
    assert m["smd_kl"] == pytest.approx(float(expected_kl))
    assert float(smd) == pytest.approx(float(base) + 0.3 * float(expected_kl))
    with pytest.raises(ValueError, match="smd needs distill_kl"):
        policy_loss(logp, old, adv, mask, LossConfig(loss_type="smd"))
    with pytest.raises(ValueError, match="takes no distill_kl"):
        policy_loss(logp, old, adv, mask, LossConfig(), distill_kl=kl)
    with pytest.raises(ValueError, match="--loss-type='grpo'"):
        LossConfig(loss_type="grpo").validate()
    with pytest.raises(ValueError, match="--smd-kl-coef"):
        LossConfig(loss_type="smd", smd_kl_coef=-1.0).validate()


# ---- the learner against an independent computation ------------------------------------------------------
_MASKS: dict[int, torch.Tensor] = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention under a per-layer [Hq, T, T] mask set by the test (batch of one)."""
    mask = _MASKS[module.layer_idx]
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = ((query @ key.transpose(-1, -2)) * scaling).masked_fill(~mask[None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register("test_shadow_reference", _reference_attention)


def traced_rollout(model, kv):
    traces: dict[int, list[KVTraceRecord]] = {}
    engine = EmbeddedEngine(model, kv, max_batch_size=2,
                            kv_trace=lambda r: traces.setdefault(r.sample_index, []).append(r))
    params = SamplingParams(temperature=TEMP, max_new_tokens=20, ignore_eos=True)
    return engine.generate(PROMPTS, params, seed=3), traces


def trace_masks(trace: list[KVTraceRecord], total: int, group: int) -> dict[int, torch.Tensor]:
    """Per layer [Hq, T, T]: what the engine's cache held for each query (its kv_trace, not the record)."""
    n_layers, n_kv = trace[0].held_positions.shape[:2]
    masks = torch.zeros(n_layers, n_kv, total, total, dtype=torch.bool)
    for rec in trace:
        for q in rec.query_positions:
            for layer in range(n_layers):
                for h in range(n_kv):
                    held = rec.held_positions[layer, h].long()
                    masks[layer, h, q, held[held <= q]] = True
    return {layer: masks[layer].repeat_interleave(group, dim=0) for layer in range(n_layers)}


def reference_objective(model, outs, traces, advantages, coef):
    """GRPO on pi_shadow + coef * KL(pi_dense || sg(pi_shadow)), seq-mean-token-mean, first step (pi_old = the
    shadow policy of these weights): written out per sample, shadow attention from the engine's trace."""
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    per_seq = []
    for i, out in enumerate(outs):
        ids = torch.tensor([out.prompt_ids + out.response_ids])
        total, p = ids.shape[1] - 1, len(out.prompt_ids)
        _MASKS.clear()
        _MASKS.update(trace_masks(traces[i], total, group))
        previous = model.config._attn_implementation
        model.config._attn_implementation = "test_shadow_reference"
        try:
            shadow_logits = model(input_ids=ids[:, :total]).logits[0, p - 1:] / TEMP
        finally:
            model.config._attn_implementation = previous
        dense_logits = model(input_ids=ids[:, :total]).logits[0, p - 1:] / TEMP
        target = ids[0, p:]
        logp = shadow_logits.log_softmax(-1).gather(1, target[:, None]).squeeze(1)
        ratio = torch.exp(logp - logp.detach())  # = 1, inside the clip: the PPO term's gradient is -A grad logp
        kl = kl_divergence(Categorical(logits=dense_logits), Categorical(logits=shadow_logits.detach()))
        per_seq.append((-advantages[i] * ratio + coef * kl).mean())
    _MASKS.clear()
    return torch.stack(per_seq).mean()


def samples_from(outs, rewards):
    return [Sample(prompt_index=i // 1, prompt_ids=o.prompt_ids, response_ids=o.response_ids,
                   rollout_logprobs=o.logprobs, finish_reason=o.finish_reason, reward=r, kv=o.kv,
                   evictions=o.evictions) for i, (o, r) in enumerate(zip(outs, rewards))]


@pytest.mark.parametrize("granularity", ["head", "model"])
def test_smd_gradient_equals_independent_autograd(granularity):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    outs, traces = traced_rollout(model, KVCompressConfig(method="rkv", budget=8, buffer=4, window=2, kernel_size=3,
                                                          granularity=granularity))
    assert all(o.kv.compressions > 0 for o in outs)
    samples = samples_from(outs, [1.0, 0.0, 0.5])
    for s in samples:
        s.prompt_index = 0  # one group: GRPO advantages from these three rewards
    coef = 0.7
    loss_cfg = LossConfig(loss_type="smd", smd_kl_coef=coef)
    learner = EmbeddedLearner(model, loss_cfg, optim=OptimConfig(lr=1e-3, clip_grad=0.0),
                              batching=MicroBatching(max_tokens=40), temperature=TEMP)  # several micro-batches
    prepared = prepare_rollout(samples, learner, CorrectionConfig(), plan=RolloutPlan(trains_shadow=True))
    assert prepared.metrics["shadow/abs_diff_max"] < 1e-5  # pi_shadow recomputed == pi_sparse
    assert prepared.batch.weights is None and all(bool(m.all()) for m in prepared.batch.loss_masks)

    reference = copy.deepcopy(model).train()
    objective = reference_objective(reference, outs, traces, prepared.batch.advantages, coef)
    ref_grads = torch.autograd.grad(objective, list(reference.parameters()))

    metrics = learner.train_step(prepared.batch)
    assert metrics["train/loss"] == pytest.approx(objective.item(), rel=1e-5, abs=1e-7)
    assert metrics["smd_kl"] * coef == pytest.approx(objective.item(), rel=1e-3)  # advantages sum to ~0: ~all KL
    assert metrics["smd_kl"] > 1e-5
    assert metrics["smd_kl"] > 0
    for (name, p), g in zip(model.named_parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-4, msg=name)


def test_shadow_rollout_trains_on_pi_shadow_without_correction():
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    outs, _ = traced_rollout(model, KVCompressConfig(method="snapkv", budget=8, buffer=4, window=2, kernel_size=3))
    samples = samples_from(outs, [1.0, 0.0, 0.0])
    for s in samples:
        s.prompt_index = 0
    learner = EmbeddedLearner(model, LossConfig(loss_type="shadow"), optim=OptimConfig(lr=1e-3), temperature=TEMP)
    # a correction that would reject every token under sparse_rl: shadow trains on all of them anyway
    strict = CorrectionConfig(token_mask_low=0.999999, token_mask_high=1.000001)
    dense = prepare_rollout(samples, learner, strict)
    shadow = prepare_rollout(samples, learner, strict, plan=RolloutPlan(trains_shadow=True))
    assert dense.metrics["mismatch/k3"] > 1e-5 and shadow.metrics["mismatch/k3"] == dense.metrics["mismatch/k3"]
    assert shadow.metrics["shadow/abs_diff_max"] < 1e-5 and shadow.metrics["shadow/k3"] < 1e-9
    assert sum(float(m.sum()) for m in dense.batch.loss_masks) < sum(len(o.response_ids) for o in outs)
    assert all(bool(m.all()) for m in shadow.batch.loss_masks) and shadow.batch.weights is None
    metrics = learner.train_step(shadow.batch)
    assert metrics["pg_clipfrac"] == 0.0 and abs(metrics["ppo_kl"]) < 1e-6  # first step: exactly on-policy
    assert metrics["smd_kl"] == 0.0
    shadow.batch.evictions = None
    with pytest.raises(ValueError, match="eviction records"):
        learner.train_step(shadow.batch)


def test_a_compressed_sample_without_record_is_refused_by_the_shadow_losses_only():
    """An SGLang sample retracted after a compression (or from a server whose plugin ships no records) has
    compressions but no record: its shadow log-probs would silently be dense ones."""
    record = EvictionRecord.from_events([(5, torch.tensor([0, 1, 4]).view(1, 1, 3))])
    ok = Sample(prompt_index=0, prompt_ids=[1] * 4, response_ids=[2] * 3, rollout_logprobs=[0.0] * 3,
                finish_reason="length", kv=KVStats(compressions=1), evictions=record)
    dense = Sample(prompt_index=0, prompt_ids=[1] * 4, response_ids=[2] * 3, rollout_logprobs=[0.0] * 3,
                   finish_reason="length")
    lost = Sample(prompt_index=3, prompt_ids=[1] * 4, response_ids=[2] * 3, rollout_logprobs=[0.0] * 3,
                  finish_reason="length", kv=KVStats(compressions=2))
    assert shadow_records([ok, dense], trains_shadow=True) == [record, None]
    assert shadow_records([ok, lost], trains_shadow=False) is None
    for loss_type in ("shadow", "smd"):
        with pytest.raises(ValueError, match="--loss-type shadow / smd: sample 2 \\(prompt index 3\\) .* 2 cache "
                                             "compressions but came without an eviction record"):
            shadow_records([ok, dense, lost], LossConfig(loss_type=loss_type).trains_shadow)
