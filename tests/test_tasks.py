"""Tests of the embedded default task: generator, reward, tokenizer, tiny model, assets, warm start."""
from __future__ import annotations

import json
import sys
import re

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from slime_sparse.tasks.assets import AssetsConfig, build_assets, load_rows
from slime_sparse.tasks.evaluate import evaluate, generate, sink_window_mask
from slime_sparse.tasks.repeated_add import (
    RepeatedAddConfig,
    generate_dataset,
    make_prompt,
    make_response,
    parse_answer,
    parse_prompt,
    read_jsonl,
    task_reward,
    with_direct_answers,
    write_jsonl,
)
from slime_sparse.tasks.tiny_model import TinyModelConfig, build_tiny_model, count_parameters
from slime_sparse.tasks.tokenizer import (
    BOS_TOKEN,
    DEFAULT_CHARSET,
    EOS_TOKEN,
    build_char_tokenizer,
    load_tokenizer,
    save_tokenizer,
)
from slime_sparse.tasks.warm_start import (
    IGNORE_INDEX,
    WarmStartConfig,
    collate,
    length_groups,
    lr_at,
    prompt_window_mask,
    response_loss,
    warm_start,
)

MICRO_MODEL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


# ---------------------------------------------------------------- generator


def _check_scratchpad(prompt: str, response: str, label: str) -> None:
    """Re-derive every scratchpad step from the prompt, independently of the generator."""
    start, step, count = map(int, re.fullmatch(r"(\d+)\+(\d+)\*(\d+)=", prompt).groups())
    body, answer = response.split("#")
    steps = body.split(";")
    assert len(steps) == count
    total = start
    for i, text in enumerate(steps):
        k, a, b, c = map(int, re.fullmatch(r"(\d+):(\d+)\+(\d+)=(\d+)", text).groups())
        assert (k, a, b) == (count - i, total, step)  # steps left, counting down; the state restated
        assert c == a + b
        total = c
    assert int(answer) == total == start + step * count == int(label)


def test_generated_scratchpads_are_correct():
    config = RepeatedAddConfig(min_start=0, max_start=150, min_step=1, max_step=12, min_count=1, max_count=6)
    rows = generate_dataset(400, seed=7, config=config)
    counts = set()
    for row in rows:
        _check_scratchpad(row["prompt"], row["response"], row["label"])
        start, step, count = parse_prompt(row["prompt"])
        assert 0 <= start <= 150 and 1 <= step <= 12
        counts.add(count)
    assert counts == set(range(1, 7))  # the whole inclusive range is used
    assert len({r["prompt"] for r in rows}) == len(rows)


def test_hand_example():
    assert make_prompt(42, 7, 4) == "42+7*4="
    assert make_response(42, 7, 4) == "4:42+7=49;3:49+7=56;2:56+7=63;1:63+7=70#70"
    assert parse_prompt("42+7*4=") == (42, 7, 4)
    with pytest.raises(ValueError, match="prompt"):
        parse_prompt("42+7=")


def test_default_task_is_long_relative_to_a_small_kv_budget():
    rows = generate_dataset(500, seed=0)
    response_tokens = [len(r["response"]) + 1 for r in rows]  # char-level, + EOS
    prompt_tokens = [len(r["prompt"]) + 1 for r in rows]  # + <s>
    assert min(response_tokens) >= 30 and sum(response_tokens) / len(rows) >= 50 and max(response_tokens) <= 96
    assert max(prompt_tokens) <= 10  # the prompt alone fits any budget


def test_direct_answers_replace_a_seeded_fraction_of_the_demonstrations():
    rows = generate_dataset(400, seed=0)
    mixed = with_direct_answers(rows, 0.6, seed=3)
    assert mixed == with_direct_answers(rows, 0.6, seed=3) and mixed != with_direct_answers(rows, 0.6, seed=4)
    direct = [m for m in mixed if ":" not in m["response"]]
    assert 0.5 < len(direct) / len(rows) < 0.7
    for r, m in zip(rows, mixed):
        assert (m["prompt"], m["label"]) == (r["prompt"], r["label"])
        assert m["response"] in (r["response"], "#" + r["label"])
        assert task_reward(m["response"], m["label"]) == 1.0  # a bare answer is a well-formed, correct demonstration
    assert rows[0]["response"].count(";")  # the input rows are not modified
    assert with_direct_answers(rows, 0.0, seed=0) == rows and all(m["response"][0] == "#" for m in with_direct_answers(rows, 1.0, 0))
    with pytest.raises(ValueError, match="fraction"):
        with_direct_answers(rows, 1.5, seed=0)


def test_generation_is_seeded_and_splits_are_disjoint():
    a = generate_dataset(50, seed=1)
    assert a == generate_dataset(50, seed=1)
    assert a != generate_dataset(50, seed=2)
    test = generate_dataset(50, seed=2, exclude_prompts=[r["prompt"] for r in a])
    assert not {r["prompt"] for r in a} & {r["prompt"] for r in test}


def test_generator_capacity_and_bad_configs():
    tiny = RepeatedAddConfig(min_start=1, max_start=2, min_step=3, max_step=3, min_count=1, max_count=2)
    assert tiny.num_problems == 4
    everything = generate_dataset(4, seed=0, config=tiny)  # drawing the whole space terminates
    assert {r["prompt"] for r in everything} == {"1+3*1=", "1+3*2=", "2+3*1=", "2+3*2="}
    with pytest.raises(ValueError, match="only 1 are left"):  # 3 of the 4 excluded (+1 foreign prompt)
        generate_dataset(2, 0, tiny, exclude_prompts=["1+3*1=", "1+3*2=", "2+3*1=", "9+9*9="])
    with pytest.raises(ValueError, match="max_start"):
        generate_dataset(1, 0, RepeatedAddConfig(min_start=5, max_start=4))
    with pytest.raises(ValueError, match="min_count"):
        generate_dataset(1, 0, RepeatedAddConfig(min_count=0))
    with pytest.raises(ValueError, match="n=-1"):
        generate_dataset(-1, 0)


def test_jsonl_round_trip(tmp_path):
    rows = generate_dataset(5, seed=3)
    path = write_jsonl(tmp_path / "d" / "x.jsonl", rows)
    assert read_jsonl(path) == rows
    assert all(set(json.loads(line)) == {"prompt", "label", "response"} for line in path.read_text().splitlines())


# ---------------------------------------------------------------- reward


@pytest.mark.parametrize(
    "response, label, finish_reason, expected",
    [
        ("1:3+5=8;2:8+5=13#13", "13", "stop", 1.0),
        ("1:3+5=8;2:8+5=13#13", 13, "stop", 1.0),  # int label
        ("1:3+5=8;2:8+5=13#13</s>", "13", "stop", 1.0),  # decoded with special tokens
        ("1:3+5=8;2:8+5=14#14", "13", "stop", 0.0),  # wrong answer
        ("1:3+5=9;2:9+5=14#13", "13", "stop", 1.0),  # only the final answer is verified
        ("1:3+5=8;2:8+5=13#13", "13", "length", 0.0),  # truncated, even though the text looks right
        ("1:3+5=8;2:8+5=13#1", "13", "length", 0.0),  # truncated mid-answer
        ("1:3+5=8;2:8+5=13", "13", "stop", 0.0),  # no answer mark
        ("1:3+5=8#8;2:8+5=13#13", "13", "stop", 0.0),  # two answer marks
        ("1:3+5=8;2:8+5=13#13;", "13", "stop", 0.0),  # junk after the answer
        ("#", "10", "stop", 0.0),
        ("", "10", "stop", 0.0),
    ],
)
def test_task_reward(response, label, finish_reason, expected):
    assert task_reward(response, label, finish_reason=finish_reason) == expected


def test_parse_answer():
    assert parse_answer("1+2=3#3") == 3
    assert parse_answer(" 1+2=3#3 \n") == 3
    assert parse_answer("1+2=3#x") is None
    assert parse_answer("1+2=3") is None


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_is_character_level(tokenizer):
    text = "42+7*2=1:42+7=49;2:49+7=56#56"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.convert_ids_to_tokens(ids[0]) == BOS_TOKEN
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == list(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id]) == BOS_TOKEN + text + EOS_TOKEN
    assert len(tokenizer) == 4 + len(DEFAULT_CHARSET)
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}) == 4
    every = DEFAULT_CHARSET  # spaces and punctuation survive too
    assert tokenizer.decode(tokenizer(every, add_special_tokens=False)["input_ids"]) == every
    assert tokenizer("A", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_tokenizer_save_load_round_trip(tokenizer, tmp_path):
    save_tokenizer(tokenizer, tmp_path / "tok")
    for loaded in (load_tokenizer(tmp_path / "tok"), AutoTokenizer.from_pretrained(str(tmp_path / "tok"))):
        for text in ("12345=", "1+2=3;3+4=7#7", "ab c?"):
            assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (
            tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
        )
        batch = loaded(["1=", "123="], padding=True)["input_ids"]
        assert batch[0][:2] == [loaded.pad_token_id] * 2  # left padding for generation
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "missing")


def test_tokenizer_rejects_duplicate_charset():
    with pytest.raises(ValueError, match="duplicate"):
        build_char_tokenizer("0123=1")


# ---------------------------------------------------------------- tiny model


def _qwen2_param_count(vocab: int, h: int, layers: int, heads: int, kv_heads: int, mlp: int) -> int:
    """Qwen2 parameters re-derived by hand: q/k/v have biases, o and the MLP do not, tied LM head."""
    head_dim = h // heads
    kv = kv_heads * head_dim
    attention = (h * h + h) + 2 * (h * kv + kv) + h * h
    per_layer = attention + 3 * h * mlp + 2 * h  # + input and post-attention RMSNorm weights
    return vocab * h + layers * per_layer + h  # + final norm


def test_tiny_model_default_size_and_config(tokenizer):
    model = build_tiny_model(tokenizer)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 128, 4, 2)
    assert cfg.intermediate_size == 256 and cfg.vocab_size == len(tokenizer)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    expected = _qwen2_param_count(len(tokenizer), 128, 4, 4, 2, 256)
    assert count_parameters(model) == expected
    assert 0.55e6 < expected < 0.65e6


def test_tiny_model_is_seeded(tokenizer):
    a = build_tiny_model(tokenizer, MICRO_MODEL, seed=1)
    b = build_tiny_model(tokenizer, MICRO_MODEL, seed=1)
    c = build_tiny_model(tokenizer, MICRO_MODEL, seed=2)
    assert count_parameters(a) == _qwen2_param_count(len(tokenizer), 32, 2, 4, 2, 64)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_tiny_model_rejects_bad_config(tokenizer):
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_tiny_model(tokenizer, TinyModelConfig(num_heads=4, num_kv_heads=3))
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_model(tokenizer, TinyModelConfig(hidden_size=130, num_heads=4))


# ---------------------------------------------------------------- warm start


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


def test_length_groups_are_the_cheapest_split():
    """Against every split of the sorted rows into contiguous parts (brute force), and every row once."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(30):
        lengths = [rng.choice([rng.randint(8, 14), rng.randint(40, 95)]) for _ in range(rng.randint(1, 9))]
        overhead = rng.choice([0, 10, 256, 10_000])
        parts = length_groups(lengths, overhead)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        cost = lambda ps: sum(len(p) * max(lengths[i] for i in p) + overhead for p in ps)  # noqa: E731
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        best = min(cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))])
                   for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k))
        assert cost(parts) == best
    assert length_groups([12] * 16 + [90] * 16) == [list(range(16)), list(range(16, 32))]  # bare | worked
    assert len(length_groups([12, 90], overhead=10_000)) == 1  # a part costs more than the padding it saves


def test_micro_batches_give_the_batch_gradient(tokenizer):
    """The warm start's split of a batch by length (loss sums over parts / the batch's tokens) is the same
    loss and gradient as one padded batch, window masks included."""
    from slime_sparse.tasks.warm_start import collate_encoded, encode, response_nll

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
    monkeypatch.setattr(ws, "length_groups", _raise_after(ws.length_groups, 17))  # once per step: stops in step 18
    with pytest.raises(KeyboardInterrupt):
        warm_start(build_tiny_model(tokenizer, MICRO_MODEL, seed=0), tokenizer, rows, cfg, log=None,
                   checkpoint=ckpt, checkpoint_every=5, progress=False)
    monkeypatch.undo()
    assert ckpt.is_file()
    resumed = build_tiny_model(tokenizer, MICRO_MODEL, seed=0)  # the fresh weights a rerun builds first
    metrics = warm_start(resumed, tokenizer, rows, cfg, log=None, checkpoint=ckpt, checkpoint_every=5, progress=False)
    assert metrics.resumed_from == 15 and metrics.steps == 25
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters()))


def test_an_interrupted_asset_build_resumes(tmp_path, monkeypatch):
    ws = sys.modules["slime_sparse.tasks.warm_start"]  # the package exports a function of the same name

    config = _micro_assets(warm_start=WarmStartConfig(steps=8, batch_size=4))
    reference = build_assets(tmp_path / "a", config, log=None, progress=False)
    real = ws._train

    def interrupted(*args):
        args = list(args)
        args[6] = 2  # checkpoint_every
        monkeypatch.setattr(ws, "length_groups", _raise_after(ws.length_groups, 5))  # stops in step 6
        return real(*args)

    monkeypatch.setattr(ws, "_train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_assets(tmp_path / "b", config, log=None, progress=False)
    monkeypatch.undo()
    partial = tmp_path / "b" / f".repeated_add-{config.key()}.partial"
    assert (partial / "warm_start.ckpt").is_file() and not (tmp_path / "b" / reference.root.name).exists()
    resumed = build_assets(tmp_path / "b", config, log=None, progress=False)
    assert not resumed.cache_hit and not partial.exists()
    assert not (resumed.root / "warm_start.ckpt").exists()
    weights = "model.safetensors"
    assert (resumed.model_dir / weights).read_bytes() == (reference.model_dir / weights).read_bytes()


def _raise_after(fn, n):
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > n:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)
    return wrapped


# ---------------------------------------------------------------- sampling helper


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


# ---------------------------------------------------------------- assets


def _micro_assets(**overrides) -> AssetsConfig:
    base = dict(
        task=RepeatedAddConfig(min_count=1, max_count=3),
        model=MICRO_MODEL,
        warm_start=WarmStartConfig(steps=2, batch_size=4),
        n_train=40,
        n_test=8,
    )
    base.update(overrides)
    return AssetsConfig(**base)


def test_assets_build_then_cache_hit(tmp_path):
    config = _micro_assets()
    first = build_assets(tmp_path, config, log=None)
    assert not first.cache_hit
    for path in (first.train_path, first.test_path, first.metadata_path, first.tokenizer_dir / "tokenizer.json"):
        assert path.is_file()
    for model_dir in (first.init_model_dir, first.model_dir):
        assert (model_dir / "model.safetensors").is_file() and (model_dir / "config.json").is_file()
    train, test = load_rows(first, "train"), load_rows(first, "test")
    assert len(train) == 40 and len(test) == 8
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    meta = first.metadata()
    assert meta["key"] == config.key() and meta["warm_start"]["steps"] == 2

    # The warm-started model differs from the initial one and reloads with from_pretrained.
    init = Qwen2ForCausalLM.from_pretrained(str(first.init_model_dir))
    warm = Qwen2ForCausalLM.from_pretrained(str(first.model_dir))
    assert not all(torch.equal(p, q) for p, q in zip(init.parameters(), warm.parameters()))
    assert AutoTokenizer.from_pretrained(str(first.model_dir))("12=")["input_ids"] == [1, 5, 6, 18]

    mtime = first.model_dir.joinpath("model.safetensors").stat().st_mtime_ns
    second = build_assets(tmp_path, config, log=None)
    assert second.cache_hit and second.root == first.root
    assert second.model_dir.joinpath("model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.root.name]  # no staging leftovers


def test_assets_key_depends_on_every_parameter(tmp_path):
    base = _micro_assets()
    variants = [
        _micro_assets(n_train=41),
        _micro_assets(seed=1),
        _micro_assets(task=RepeatedAddConfig(min_count=1, max_count=4)),
        _micro_assets(model=TinyModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=64)),
        _micro_assets(warm_start=WarmStartConfig(steps=3, batch_size=4)),
        _micro_assets(warm_start=None),
    ]
    keys = {base.key()} | {v.key() for v in variants}
    assert len(keys) == 1 + len(variants)
    assert base.key() == _micro_assets().key()
    # the warm start's threads change its float sums, hence the assets
    assert _micro_assets(warm_start=WarmStartConfig(steps=2, batch_size=4, threads=None)).key() != base.key()
    other = build_assets(tmp_path, _micro_assets(warm_start=None), log=None)
    assert not other.cache_hit and other.root.name.endswith(_micro_assets(warm_start=None).key())
    assert other.metadata()["warm_start"] is None


def test_assets_reject_bad_config(tmp_path):
    with pytest.raises(ValueError, match="n_train"):
        build_assets(tmp_path, _micro_assets(n_train=0), log=None)
    with pytest.raises(ValueError, match="distinct"):  # 90 * 8 * 3 problems in the micro task ranges
        build_assets(tmp_path, _micro_assets(n_train=2000, n_test=200), log=None)
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- the default assets, end to end


@pytest.mark.slow
def test_default_assets_land_in_the_rl_sweet_spot(tmp_path):
    """The default build (~2-3 min of CPU, one thread) answers bare (a guess) for most prompts under greedy
    decoding while its scratchpad is mostly right: GRPO has something to learn. The scratchpad survives a
    cache of the prompt + a recent window, not one of 2 sinks + the last 8 tokens.

    The recent window is 24, the main job's --kv-budget and inside the warm start's trained windows (16-48). At
    their lower edge (16, the main job's budget when this test was written) accuracy falls off a cliff whose
    position moves with the float path: the assets of the one-thread micro-batched warm start on an AMD EPYC
    keep 0.60 of 0.86 at 16 (12: 0.05, 20: 0.79, 24: 0.84, 32: 0.86; 43 worked answers), #45."""
    paths = build_assets(tmp_path, AssetsConfig(), log=None)
    model = Qwen2ForCausalLM.from_pretrained(str(paths.model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(paths.model_dir))
    rows = load_rows(paths, "test")[:128]

    def scores(**kwargs) -> tuple[float, float, float]:
        """accuracy, fraction of bare answers, accuracy of the worked answers"""
        gens = generate(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=96, **kwargs)
        correct = [task_reward(g.text, r["label"], g.finish_reason) for g, r in zip(gens, rows)]
        worked = [c for c, g in zip(correct, gens) if not g.text.startswith("#")]
        return sum(correct) / len(rows), 1 - len(worked) / len(rows), sum(worked) / max(1, len(worked))

    greedy, bare, worked = scores()
    assert greedy <= 0.5 and bare >= 0.5 and worked >= 0.8
    sampled, sampled_bare, sampled_worked = scores(temperature=1.0)
    assert 0.25 <= sampled <= 0.7 and sampled_worked >= 0.6
    assert scores(window=24, keep_prompt=True)[2] >= 0.8 * worked
    assert scores(window=8, n_sink=2)[2] <= 0.3
