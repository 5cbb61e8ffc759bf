"""The default task (slime_sparse/tasks/repeated_add.py): generator, scratchpads, splits, jsonl, reward."""
from __future__ import annotations

import json
import re

import pytest

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
