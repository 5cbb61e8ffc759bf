"""Dense GRPO moves the policy towards reward: a few updates on one fixed batch raise that batch's reward.

The whole update path of the training loop runs (embedded engine samples -> group advantages -> dense
recompute -> correction -> PPO loss -> AdamW steps of the embedded learner); only the reward is a toy one
whose expectation is exact: 1 when the first response token is a digit. The expected reward of a prompt is
then the policy's probability mass on the digit tokens at the first response position, so the test compares
exact numbers before and after, not noisy samples. A sign error anywhere (advantages, surrogate, loss
aggregation) lowers that mass and fails the test.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from slime_sparse.algo import CorrectionConfig, LossConfig
from slime_sparse.backends.embedded.learner import EmbeddedLearner
from slime_sparse.backends.optimizer import OptimConfig
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.pipeline import prepare_rollout, split_steps, to_samples
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.tasks.tiny_model import TinyModelConfig, build_tiny_model
from slime_sparse.tasks.tokenizer import build_char_tokenizer

MICRO_MODEL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
PROMPTS = ["12+3*4=", "57+8*3=", "20+9*5=", "33+2*6=", "71+4*4=", "45+6*7="]


@torch.no_grad()
def expected_reward(model, tokenizer, prompts: list[list[int]], digit_ids: torch.Tensor) -> float:
    """Mean over prompts of P(first response token is a digit) under `model` (exact, no sampling)."""
    probs = [torch.softmax(model(torch.tensor([p])).logits[0, -1], dim=-1)[digit_ids].sum() for p in prompts]
    return float(torch.stack(probs).mean())


def grpo_on_fixed_batch(n_epochs: int, seed: int = 0) -> tuple[list[float], dict]:
    """Expected reward of the batch's prompts before and after each PPO epoch over one fixed rollout batch."""
    tokenizer = build_char_tokenizer()
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    policy = build_tiny_model(tokenizer, MICRO_MODEL, seed=seed)
    sampler = build_tiny_model(tokenizer, MICRO_MODEL, seed=seed)  # the engine's copy, same weights
    records = [SimpleNamespace(index=i, label=None, prompt_ids=tokenizer(p)["input_ids"]) for i, p in enumerate(PROMPTS)]
    prompts = [r.prompt_ids for r in records]
    n = 8
    engine = EmbeddedEngine(sampler, KVCompressConfig(method="none"), max_batch_size=64)
    outputs = engine.generate([p for p in prompts for _ in range(n)], SamplingParams(temperature=1.0, max_new_tokens=3),
                              seed=seed)
    samples = to_samples(records, outputs, n)
    for s in samples:
        s.reward = float(s.response_ids[0] in set(digit_ids.tolist()))

    learner = EmbeddedLearner(policy, LossConfig(eps_clip=0.2), optim=OptimConfig(lr=3e-3, betas=(0.9, 0.98)))
    curve = [expected_reward(policy, tokenizer, prompts, digit_ids)]
    prepared = prepare_rollout(samples, learner, CorrectionConfig())  # GRPO with std normalisation, no correction
    for _ in range(n_epochs):  # PPO epochs over the same samples, two optimizer steps each
        for part in split_steps(prepared.batch, 2):
            learner.train_step(part)
        curve.append(expected_reward(policy, tokenizer, prompts, digit_ids))
    return curve, prepared.metrics


def test_a_few_dense_grpo_updates_raise_the_reward_of_their_prompts():
    curve, metrics = grpo_on_fixed_batch(n_epochs=4)
    print(curve)
    assert metrics["adv/zero_std_groups"] < len(PROMPTS)  # some groups mix digits and non-digits: a signal
    assert 0.05 < curve[0] < 0.5  # a random policy: digits are 10 of the ~60 tokens
    assert all(b > a for a, b in zip(curve, curve[1:])), curve  # every epoch moves towards the reward
    assert curve[-1] > curve[0] + 0.03, curve
