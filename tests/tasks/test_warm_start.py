"""The warm start (slime_sparse/tasks/warm_start.py): collation, window masks, the loss, its schedule, resume."""
from __future__ import annotations

import sys

import pytest
import torch

from slime_sparse.tasks.repeated_add import RepeatedAddConfig, generate_dataset, with_direct_answers
from slime_sparse.tasks.tiny_model import build_tiny_model
from slime_sparse.tasks.tokenizer import BOS_TOKEN, EOS_TOKEN
from slime_sparse.tasks.warm_start import (
    IGNORE_INDEX,
    WarmStartConfig,
    collate,
    lr_at,
    prompt_window_mask,
    response_loss,
    warm_start,
)
from tests.tasks.common import MICRO_MODEL, raise_after


def test_collate_labels_only_the_response(tokenizer):
    rows = [{"prompt": "1+2*1=", "response": "1:1+2=3#3"}, {"prompt": "34+5*2=", "response": "1:34+5=39;2:39+5=44#44"}]
    batch = collate(tokenizer, rows)
    for i, row in enumerate(rows):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert tokenizer.decode(ids) == BOS_TOKEN + row["prompt"] + row["response"] + EOS_TOKEN
        labelled = batch["labels"][i][batch["labels"][i] != IGNORE_INDEX].tolist()
        assert tokenizer.decode(labelled) == row["response"] + EOS_TOKEN
        # Labels sit exactly on the response positions (same index as input_ids; the loss shifts).
        start = 1 + len(row["prompt"])
        assert batch["labels"][i][:start].eq(IGNORE_INDEX).all()
        assert batch["labels"][i][start : start + len(labelled)].tolist() == ids[start:]
    with pytest.raises(ValueError, match="response"):
        collate(tokenizer, [{"prompt": "1+2*1="}])


def test_prompt_window_mask_by_hand():
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    mask = prompt_window_mask(attention_mask, prompt_lens=torch.tensor([2, 3]), windows=torch.tensor([2, 0]))
    visible = (mask[:, 0] == 0).int().tolist()
    assert visible[0] == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],  # prompt rows: causal
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 1, 0, 0, 0],  # prompt + last 2
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 1],  # padding sees itself only
    ]
    assert visible[1] == torch.tril(torch.ones(8, 8, dtype=torch.int)).tolist()  # window 0 = dense


def test_response_loss_under_window_masks(tokenizer):
    model = build_tiny_model(tokenizer, MICRO_MODEL, seed=2)
    rows = generate_dataset(3, seed=4, config=RepeatedAddConfig(min_count=2, max_count=4))
    batch = collate(tokenizer, rows)
    assert batch["prompt_lens"].tolist() == [1 + len(r["prompt"]) for r in rows]
    with torch.no_grad():
        dense = response_loss(model, batch)
        zero = response_loss(model, {**batch, "attention_mask": prompt_window_mask(
            batch["attention_mask"], batch["prompt_lens"], torch.zeros(3, dtype=torch.long))})
        wide = response_loss(model, {**batch, "attention_mask": prompt_window_mask(
            batch["attention_mask"], batch["prompt_lens"], torch.full((3,), 1000))})
        narrow = response_loss(model, {**batch, "attention_mask": prompt_window_mask(
            batch["attention_mask"], batch["prompt_lens"], torch.full((3,), 4))})
        # Reference for the narrow window: each row alone, with a loop-built boolean mask.
        total, count = 0.0, 0
        for r, p in zip(rows, batch["prompt_lens"].tolist()):
            ids = tokenizer(r["prompt"])["input_ids"] + tokenizer(r["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            n = len(ids)
            allowed = torch.tensor([[j <= i and (i < p or j < p or j > i - 4) for j in range(n)] for i in range(n)])
            m = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids]), attention_mask=m).logits[0], -1)
            total -= sum(logp[t - 1, ids[t]].item() for t in range(p, n))
            count += n - p
    torch.testing.assert_close(zero, dense)
    torch.testing.assert_close(wide, dense)
    assert narrow.item() == pytest.approx(total / count, rel=1e-5)
    assert abs(narrow.item() - dense.item()) > 1e-4


def test_lr_schedule():
    cfg = WarmStartConfig(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1)
    # A time budget that runs out first drives the decay: half the time gone = half way through.
    assert lr_at(20, cfg, time_fraction=0.5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(60, cfg, time_fraction=0.1) == pytest.approx(0.1 + 0.9 * 0.5)  # steps ahead: steps rule
    assert lr_at(5, cfg, time_fraction=0.9) == pytest.approx(0.6)  # warmup is by steps


def test_warm_start_lowers_loss_and_is_deterministic(tokenizer):
    rows = generate_dataset(16, seed=5, config=RepeatedAddConfig(min_count=1, max_count=3))
    batch = collate(tokenizer, rows)
    cfg = WarmStartConfig(steps=30, batch_size=8, lr=1e-2, warmup_steps=3, seed=3)
    finals = []
    for _ in range(2):
        model = build_tiny_model(tokenizer, MICRO_MODEL, seed=0)
        with torch.no_grad():
            before = response_loss(model, batch).item()
        metrics = warm_start(model, tokenizer, rows, cfg, log=None)
        with torch.no_grad():
            after = response_loss(model, batch).item()
        assert metrics.steps == 30 and not metrics.stopped_by_time
        assert after < 0.75 * before
        assert metrics.final_loss < metrics.first_loss
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*finals))


def test_warm_start_with_window_masks_lowers_the_masked_loss(tokenizer):
    rows = generate_dataset(16, seed=5, config=RepeatedAddConfig(min_count=2, max_count=4))
    batch = collate(tokenizer, rows)
    masked = {**batch, "attention_mask": prompt_window_mask(batch["attention_mask"], batch["prompt_lens"], torch.full((16,), 6))}
    model = build_tiny_model(tokenizer, MICRO_MODEL, seed=0)
    with torch.no_grad():
        before = response_loss(model, masked).item()
    cfg = WarmStartConfig(steps=30, batch_size=8, lr=1e-2, warmup_steps=3, window_mask_prob=1.0, window_range=(6, 6))
    warm_start(model, tokenizer, rows, cfg, log=None)
    with torch.no_grad():
        assert response_loss(model, masked).item() < 0.75 * before


def test_warm_start_time_budget_and_validation(tokenizer):
    rows = generate_dataset(4, seed=5, config=RepeatedAddConfig(min_count=1, max_count=2))
    model = build_tiny_model(tokenizer, MICRO_MODEL)
    metrics = warm_start(model, tokenizer, rows, WarmStartConfig(steps=1000, batch_size=2, time_budget_s=0.3), log=None)
    assert metrics.stopped_by_time and 1 <= metrics.steps < 1000
    with pytest.raises(ValueError, match="steps"):
        warm_start(model, tokenizer, rows, WarmStartConfig(steps=0), log=None)
    with pytest.raises(ValueError, match="empty"):
        warm_start(model, tokenizer, [], WarmStartConfig(), log=None)
    with pytest.raises(ValueError, match="window_mask_prob"):
        warm_start(model, tokenizer, rows, WarmStartConfig(window_mask_prob=1.5), log=None)
    with pytest.raises(ValueError, match="window_range"):
        warm_start(model, tokenizer, rows, WarmStartConfig(window_range=(8, 4)), log=None)


def test_micro_batches_give_the_batch_gradient(tokenizer):
    """The warm start's split of a batch by length (loss sums over parts / the batch's tokens) is the same
    loss and gradient as one padded batch, window masks included."""
    from slime_sparse.tasks.warm_start import collate_encoded, encode, length_groups, response_nll

    rows = with_direct_answers(generate_dataset(12, seed=2, config=RepeatedAddConfig(min_count=2, max_count=5)), 0.5, 0)
    enc = encode(tokenizer, rows)
    windows = torch.tensor([0, 6, 0, 0, 8, 0, 0, 0, 7, 0, 0, 0])
    model = build_tiny_model(tokenizer, MICRO_MODEL, seed=1)

    def run(parts):
        model.zero_grad()
        count = sum(len(r) for _, r in enc)
        value = 0.0
        for part in parts:
            batch = collate_encoded([enc[i] for i in part], tokenizer.pad_token_id)
            if bool(windows[part].any()):
                batch["attention_mask"] = prompt_window_mask(batch["attention_mask"], batch["prompt_lens"],
                                                             windows[part])
            loss = response_nll(model, batch)[0] / count
            loss.backward()
            value += loss.item()
        return value, [p.grad.clone() for p in model.parameters()]

    whole, whole_grad = run([list(range(12))])
    parts = length_groups([len(p) + len(r) for p, r in enc], overhead=0)
    assert len(parts) > 1
    split, split_grad = run(parts)
    assert split == pytest.approx(whole, rel=1e-5)
    for a, b in zip(whole_grad, split_grad):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_an_interrupted_warm_start_resumes_to_the_same_weights(tokenizer, tmp_path, monkeypatch):
    ws = sys.modules["slime_sparse.tasks.warm_start"]  # the package exports a function of the same name

    rows = with_direct_answers(generate_dataset(24, seed=5, config=RepeatedAddConfig(min_count=1, max_count=3)), 0.5, 0)
    cfg = WarmStartConfig(steps=25, batch_size=6, lr=1e-2, warmup_steps=3)
    straight = build_tiny_model(tokenizer, MICRO_MODEL, seed=0)
    warm_start(straight, tokenizer, rows, cfg, log=None, progress=False)

    ckpt = tmp_path / "warm.ckpt"
    monkeypatch.setattr(ws, "length_groups", raise_after(ws.length_groups, 17))  # once per step: stops in step 18
    with pytest.raises(KeyboardInterrupt):
        warm_start(build_tiny_model(tokenizer, MICRO_MODEL, seed=0), tokenizer, rows, cfg, log=None,
                   checkpoint=ckpt, checkpoint_every=5, progress=False)
    monkeypatch.undo()
    assert ckpt.is_file()
    resumed = build_tiny_model(tokenizer, MICRO_MODEL, seed=0)  # the fresh weights a rerun builds first
    metrics = warm_start(resumed, tokenizer, rows, cfg, log=None, checkpoint=ckpt, checkpoint_every=5, progress=False)
    assert metrics.resumed_from == 15 and metrics.steps == 25
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters()))
