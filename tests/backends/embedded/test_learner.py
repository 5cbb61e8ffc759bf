"""Embedded learner: dense log-probs, micro-batching invariance, rejection semantics, DP normalisers."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.algo import LossConfig
from slime_sparse.backends.base import TrainBatch
from slime_sparse.backends.batching import MicroBatching
from slime_sparse.backends.embedded.learner import EmbeddedLearner
from slime_sparse.backends.optimizer import OptimConfig
from slime_sparse.backends.logprobs import response_logprobs


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).eval()


def make_batch(n: int = 6, seed: int = 1) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    tokens, rlens = [], []
    for i in range(n):
        p, r = 3 + i % 3, 2 + (i * 5) % 7
        tokens.append(torch.randint(0, 48, (p + r,), generator=g).tolist())
        rlens.append(r)
    return TrainBatch(
        tokens=tokens, response_lens=rlens,
        advantages=torch.randn(n, generator=g),
        loss_masks=[torch.ones(r) for r in rlens],
        old_logprobs=[-torch.rand(r, generator=g) - 2.0 for r in rlens],
        weights=[0.5 + torch.rand(r, generator=g) for r in rlens],
    )


def reference_logprobs(model, tokens, rlen, temperature):
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logp = F.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
    return logp[-rlen:]


def test_response_logprobs_match_unpadded_forward():
    model = tiny_model()
    batch = make_batch()
    logp, ent = response_logprobs(model, batch.tokens, batch.response_lens, temperature=0.7, with_entropy=True)
    for i, (t, r) in enumerate(zip(batch.tokens, batch.response_lens)):
        torch.testing.assert_close(logp[i, :r], reference_logprobs(model, t, r, 0.7), atol=1e-5, rtol=1e-5)
        assert torch.all(logp[i, r:] == 0) and torch.all(ent[i, r:] == 0)
        assert torch.all(ent[i, :r] > 0)


def learner(model, max_tokens, **kw):
    batching = max_tokens if isinstance(max_tokens, MicroBatching) else MicroBatching(max_tokens)
    return EmbeddedLearner(model, LossConfig(loss_agg_mode=kw.pop("mode", "token-mean")),
                           optim=OptimConfig(lr=1e-2, clip_grad=0.0), batching=batching, **kw)


def grads_after_step(lrn: EmbeddedLearner, batch: TrainBatch) -> dict[str, torch.Tensor]:
    lrn.train_step(batch)  # gradients stay on the parameters until the next step zeroes them
    return {n: p.grad.clone() for n, p in lrn.model.named_parameters()}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_microbatching_does_not_change_the_gradient(mode):
    batch = make_batch()
    base = tiny_model()
    g_one = grads_after_step(learner(copy.deepcopy(base), 10_000, mode=mode), batch)
    g_many = grads_after_step(learner(copy.deepcopy(base), 12, mode=mode), batch)  # ~1-2 samples per micro-batch
    # slime's fixed micro-batches (--micro-batch-size, no --use-dynamic-batch-size): one and four samples each
    g_fixed_1 = grads_after_step(learner(copy.deepcopy(base), MicroBatching(None, 1), mode=mode), batch)
    g_fixed_4 = grads_after_step(learner(copy.deepcopy(base), MicroBatching(None, 4), mode=mode), batch)
    for name in g_one:
        for g in (g_many, g_fixed_1, g_fixed_4):
            torch.testing.assert_close(g[name], g_one[name], atol=1e-6, rtol=1e-5)


def test_rejected_sequence_contributes_nothing():
    batch = make_batch()
    base = tiny_model()
    rejected = copy.copy(batch)
    rejected.loss_masks = [m.clone() for m in batch.loss_masks]
    rejected.loss_masks[2].zero_()
    g_rej = grads_after_step(learner(copy.deepcopy(base), 10_000), rejected)
    keep = [i for i in range(len(batch)) if i != 2]
    g_drop = grads_after_step(learner(copy.deepcopy(base), 10_000), batch.select(keep))
    for name in g_rej:
        torch.testing.assert_close(g_rej[name], g_drop[name], atol=1e-6, rtol=1e-5)


def test_shards_with_global_normalisers_sum_to_full_batch():
    """What data parallelism relies on: per-shard grads with global counts add up to the full gradient."""
    batch = make_batch()
    base = tiny_model()
    full = grads_after_step(learner(copy.deepcopy(base), 10_000), batch)
    total_tokens = float(sum(m.sum() for m in batch.loss_masks))
    summed = None
    for shard in ([0, 2, 4], [1, 3, 5]):
        part = batch.select(shard)
        part.num_seqs, part.num_tokens = float(len(batch)), total_tokens
        g = grads_after_step(learner(copy.deepcopy(base), 10_000), part)
        summed = g if summed is None else {k: summed[k] + g[k] for k in g}
    for name in full:
        torch.testing.assert_close(summed[name], full[name], atol=1e-6, rtol=1e-5)


def test_repeated_updates_lower_the_loss_on_a_fixed_batch():
    model = tiny_model()
    lrn = EmbeddedLearner(model, LossConfig(), optim=OptimConfig(lr=3e-3), batching=MicroBatching(10_000))
    batch = make_batch(8)
    batch.old_logprobs = lrn.compute_logprobs(batch.tokens, batch.response_lens)
    losses = [lrn.train_step(batch)["train/loss"] for _ in range(8)]
    assert losses[-1] < losses[0] - 0.05, losses


def test_reference_model_is_frozen_copy():
    lrn = EmbeddedLearner(tiny_model(), LossConfig(use_kl_loss=True, kl_loss_coef=0.1), optim=OptimConfig(lr=1e-2),
                          need_ref=True)
    batch = make_batch()
    before = lrn.compute_logprobs(batch.tokens, batch.response_lens, ref=True)
    batch.old_logprobs = lrn.compute_logprobs(batch.tokens, batch.response_lens)
    batch.ref_logprobs = before
    lrn.train_step(batch)
    after_ref = lrn.compute_logprobs(batch.tokens, batch.response_lens, ref=True)
    after_pol = lrn.compute_logprobs(batch.tokens, batch.response_lens)
    for a, b, c in zip(before, after_ref, after_pol):
        assert torch.equal(a, b)
        assert not torch.allclose(a, c)


def test_missing_inputs_are_clear_errors():
    lrn = learner(tiny_model(), 10_000)
    batch = make_batch()
    batch.old_logprobs = None
    with pytest.raises(ValueError, match="old_logprobs"):
        lrn.train_step(batch)
    with pytest.raises(ValueError, match="reference"):
        lrn.compute_logprobs(batch.tokens, batch.response_lens, ref=True)


def test_weight_decay_follows_megatrons_rule():
    """With zero gradients AdamW's step is pure decoupled decay: matrices shrink by lr * wd, biases and norm
    weights (1-D) stay, as Megatron's optimizer does it (so --weight-decay means one thing on every backend)."""
    model = tiny_model()
    lr, wd = 0.1, 0.5
    lrn = EmbeddedLearner(model, LossConfig(), optim=OptimConfig(lr=lr, weight_decay=wd))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lrn.optimizer.step()
    decayed = kept = 0
    for name, p in model.named_parameters():
        if p.ndim == 1:  # norms and the q/k/v biases of Qwen2
            torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
            kept += 1
        else:
            torch.testing.assert_close(p, before[name] * (1 - lr * wd), rtol=1e-6, atol=0, msg=name)
            decayed += 1
    assert decayed and kept
