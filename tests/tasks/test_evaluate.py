"""Greedy / windowed generation and evaluation (slime_sparse/tasks/evaluate.py)."""
from __future__ import annotations

import pytest
import torch

from slime_sparse.tasks.evaluate import evaluate, generate, sink_window_mask
from slime_sparse.tasks.repeated_add import RepeatedAddConfig, generate_dataset
from slime_sparse.tasks.tiny_model import build_tiny_model
from tests.tasks.common import MICRO_MODEL


def test_sink_window_mask_by_hand():
    valid = torch.tensor([[False, False, True, True, True, True, True], [True] * 7])
    got = sink_window_mask(valid, n_sink=2, window=3)
    assert got[0].tolist() == [False, False, True, True, True, True, True]  # 5 real tokens: all kept
    assert got[1].tolist() == [True, True, False, False, True, True, True]
    assert torch.equal(sink_window_mask(valid, 2, None), valid)
    per_row = sink_window_mask(valid, torch.tensor([1, 3]), window=2)  # e.g. each row's prompt length
    assert per_row[0].tolist() == [False, False, True, False, False, True, True]
    assert per_row[1].tolist() == [True, True, True, False, False, True, True]


def test_greedy_generate_matches_hf_generate(tokenizer):
    model = build_tiny_model(tokenizer, MICRO_MODEL, seed=4)
    prompts = ["12+3*4=", "9+8*1=", "123+45*67="]  # different lengths: exercises left padding
    ours = generate(model, tokenizer, prompts, max_new_tokens=12)
    for prompt, gen in zip(prompts, ours):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        assert gen.token_ids == ref[0, ids.size(1) :].tolist()


@pytest.mark.parametrize("keep_prompt", [False, True])
def test_windowed_decode_equals_band_masked_forward(tokenizer, keep_prompt):
    """Decoding under a sinks (or whole prompt) + window cache must equal one forward pass over the
    whole sequence with the same static mask: dense over the prompt rows, and every generated
    position sees the first `n_keep` tokens + the last `window` tokens."""
    model = build_tiny_model(tokenizer, MICRO_MODEL, seed=6)
    prompt, window, n_sink, new = "12+3*45=", 4, 2, 14
    gen = generate(model, tokenizer, [prompt], new, window=window, n_sink=n_sink, keep_prompt=keep_prompt)[0]
    prompt_ids = tokenizer(prompt)["input_ids"]
    seq = prompt_ids + gen.token_ids
    n, p = len(seq), len(prompt_ids)
    n_keep = p if keep_prompt else n_sink
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            allowed[i, j] = i < p or j < n_keep or j > i - window
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq]), attention_mask=mask).logits[0]
        dense = model(input_ids=torch.tensor([seq])).logits[0]
    assert logits[p - 1 : n - 1].argmax(-1).tolist() == gen.token_ids
    # The window changes nothing over the prompt and does change what later tokens see.
    torch.testing.assert_close(logits[:p], dense[:p])
    assert (logits[-1] - dense[-1]).abs().max() > 1e-3


def test_evaluate_scores_with_the_task_reward(tokenizer):
    model = build_tiny_model(tokenizer, MICRO_MODEL, seed=0)
    rows = generate_dataset(4, seed=0, config=RepeatedAddConfig(min_count=1, max_count=2))
    result = evaluate(model, tokenizer, rows, max_new_tokens=5)
    assert result.n == 4 and result.max_response_tokens <= 5
    # An oracle reward that accepts everything that stopped turns truncation into accuracy 1 - truncated.
    oracle = evaluate(model, tokenizer, rows, 5, reward_fn=lambda text, label, finish_reason: float(finish_reason == "stop"))
    assert oracle.accuracy == pytest.approx(1.0 - oracle.truncated)
