"""Tests of the long-horizon task (slime_sparse/tasks/long_recall.py): generator, bare answers, grader, assets."""
from __future__ import annotations

import re

import pytest

from slime_sparse.tasks.assets import AssetsConfig, build_assets, load_rows
from slime_sparse.tasks.long_recall import (
    LongRecallConfig,
    bare_response,
    generate_dataset,
    make_label,
    make_prompt,
    make_response,
    parse_label,
    parse_prompt,
    score,
    task_reward,
    warm_start_demos,
    with_bare_answers,
)
from slime_sparse.tasks.tiny_model import TinyModelConfig
from slime_sparse.tasks.tokenizer import DEFAULT_CHARSET


def _rederive(prompt: str, response: str) -> None:
    """Every step of a worked answer, re-derived from the prompt independently of the generator."""
    keys, expr = prompt.split(";")
    start, step, count = map(int, re.fullmatch(r"(\d+)\+(\d+)\*(\d+)=", expr).groups())
    body, tail = response.split("#")
    steps = body.split(";")
    assert len(steps) == count
    total = start
    for i, text in enumerate(steps):
        assert text == f"{count - i}:{total}+{step}={total + step}"
        total += step
    assert tail == f"{total}>{keys}"


def test_hand_example():
    assert make_prompt("qxmf", 153, 7, 3) == "qxmf;153+7*3="
    assert make_response("qxmf", 153, 7, 3) == "3:153+7=160;2:160+7=167;1:167+7=174#174>qxmf"
    assert make_label("qxmf", 153, 7, 3) == "174>qxmf"
    assert bare_response("174>qxmf") == "#174>qxmf"
    assert parse_prompt("qxmf;153+7*3=") == ("qxmf", 153, 7, 3)
    assert parse_label("174>qxmf") == ("qxmf", "174")


def test_generated_answers_are_correct_long_and_in_the_charset():
    config = LongRecallConfig()
    rows = generate_dataset(300, seed=3, config=config)
    lengths = []
    for row in rows:
        _rederive(row["prompt"], row["response"])
        keys, start, step, count = parse_prompt(row["prompt"])
        assert len(set(keys)) == len(keys) == config.num_keys and set(keys) <= set(config.key_alphabet)
        assert config.min_start <= start <= config.max_start and config.min_count <= count <= config.max_count
        assert row["label"] == make_label(keys, start, step, count)
        assert set(row["prompt"] + row["response"]) <= set(DEFAULT_CHARSET)
        lengths.append(len(row["response"]))
    # the issue's >= 300-token answers (one character per token), the keys ~300 tokens behind the end
    assert min(lengths) >= 300 and max(lengths) <= 400


def test_generation_is_seeded_and_splits_are_disjoint():
    a = generate_dataset(200, seed=5)
    assert a == generate_dataset(200, seed=5) and a != generate_dataset(200, seed=6)
    assert len({r["prompt"] for r in a}) == 200
    b = generate_dataset(50, seed=5, exclude_prompts=[r["prompt"] for r in a])
    assert not {r["prompt"] for r in a} & {r["prompt"] for r in b}


def test_config_validation_and_capacity():
    small = LongRecallConfig(num_keys=1, key_alphabet="ab", min_start=100, max_start=100, min_step=2,
                             max_step=2, min_count=1, max_count=2)
    assert small.num_problems == 4
    assert len(generate_dataset(2, seed=0, config=small)) == 2
    with pytest.raises(ValueError, match="half"):
        generate_dataset(3, seed=0, config=small)
    with pytest.raises(ValueError, match="num_keys"):
        LongRecallConfig(num_keys=3, key_alphabet="abb").validate()
    with pytest.raises(ValueError, match="lowercase"):
        LongRecallConfig(key_alphabet="ABCDE").validate()
    with pytest.raises(ValueError, match="max_count"):
        LongRecallConfig(min_count=5, max_count=4).validate()
    with pytest.raises(ValueError, match="min_count"):
        LongRecallConfig(min_count=0).validate()
    with pytest.raises(ValueError, match="not a long-recall prompt"):
        parse_prompt("1+2*3=")


def test_bare_answers_replace_a_seeded_fraction():
    rows = generate_dataset(400, seed=1)
    mixed = with_bare_answers(rows, 0.5, seed=2)
    assert mixed == with_bare_answers(rows, 0.5, seed=2)
    bare = [m for m in mixed if m["response"].startswith("#")]
    assert 0.4 < len(bare) / len(rows) < 0.6
    for m, r in zip(mixed, rows):
        assert m["prompt"] == r["prompt"] and m["label"] == r["label"]
        assert m["response"] in (r["response"], "#" + r["label"])
        assert task_reward(m["response"], m["label"]) == 1.0  # both styles are well-formed, right demonstrations
    assert with_bare_answers(rows, 0.0, seed=2) == rows
    with pytest.raises(ValueError, match="fraction"):
        with_bare_answers(rows, 1.5, seed=0)


LABEL = "174>qxmf"
WORKED = "3:153+7=160;2:160+7=167;1:167+7=174"


@pytest.mark.parametrize("response,finish_reason,expected", [
    (WORKED + "#174>qxmf", "stop", 1.0),
    (WORKED + "#174>qxmf</s>", "stop", 1.0),  # the EOS decoded with the text is stripped
    ("#174>qxmf", "stop", 1.0),  # a right bare answer is a full score
    (WORKED + "#175>qxmf", "stop", 0.6),  # keys right, total wrong
    (WORKED + "#174>qxaf", "stop", 0.4 + 0.6 * 3 / 4),  # one key wrong
    (WORKED + "#174>xqmf", "stop", 0.4 + 0.6 * 2 / 4),  # keys compared place by place
    (WORKED + "#174>qxm", "stop", 0.4 + 0.6 * 3 / 4),  # a missing key is wrong
    (WORKED + "#174>qxmfz", "stop", 0.4 + 0.6 * 4 / 5),  # an extra key costs its place
    (WORKED + "#174>", "stop", 0.4),
    (WORKED + "#174>qxmf", "length", 0.0),  # truncated: no credit
    (WORKED + "#174>qxmf;", "stop", 0.0),  # anything after the keys: malformed
    (WORKED + "#174", "stop", 0.0),  # no keys mark
    (WORKED + "#174>qx>mf", "stop", 0.0),  # two keys marks
    (WORKED + "#1#174>qxmf", "stop", 0.0),  # two answer marks
    ("", "stop", 0.0),
])
def test_task_reward(response, finish_reason, expected):
    assert task_reward(response, LABEL, finish_reason=finish_reason) == pytest.approx(expected)


def test_score_parts_and_bad_labels():
    assert score(WORKED + "#175>qxmf", LABEL) == (0.0, 1.0)
    assert score(" #174>qxma ", LABEL) == (1.0, 0.75)
    with pytest.raises(ValueError, match="long-recall label"):
        task_reward("#1>2", "174")


def test_warm_start_demos_count_from_their_own_minimum():
    config = LongRecallConfig(warm_start_min_count=1)
    train, test = generate_dataset(300, seed=0, config=config), generate_dataset(20, seed=1, config=config)
    demos = warm_start_demos(train, test, config, 0.5, seed=4)
    assert len(demos) == len(train)
    assert not {d["prompt"] for d in demos} & {r["prompt"] for r in train + test}
    counts = [parse_prompt(d["prompt"])[3] for d in demos]
    assert min(counts) < 5 and max(counts) > 25  # the far copy shown at every distance
    for d in demos:
        assert task_reward(d["response"], d["label"]) == 1.0
        if not d["response"].startswith("#"):
            _rederive(d["prompt"], d["response"])
    assert 0.4 < sum(d["response"].startswith("#") for d in demos) / len(demos) < 0.6
    same = LongRecallConfig(warm_start_min_count=24)  # = min_count: the train problems themselves
    assert [d["prompt"] for d in warm_start_demos(train, test, same, 0.5, seed=4)] == [r["prompt"] for r in train]
    with pytest.raises(ValueError, match="min_count"):
        LongRecallConfig(warm_start_min_count=0).validate()


def test_assets_build_the_long_recall_task(tmp_path):
    from slime_sparse.tasks.warm_start import WarmStartConfig

    task = LongRecallConfig(min_count=2, max_count=3)
    config = AssetsConfig(task=task, model=TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                                           intermediate_size=64),
                          warm_start=WarmStartConfig(steps=1, batch_size=2), n_train=20, n_test=4)
    paths = build_assets(tmp_path, config, log=None)
    assert paths.root.name == f"long_recall-{config.key()}"
    train, test = load_rows(paths, "train"), load_rows(paths, "test")
    assert len(train) == 20 and len(test) == 4 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for row in train + test:
        _rederive(row["prompt"], row["response"])
    # the default task's assets keep their own prefix and key (the recipe's cached assets stay valid)
    assert config.key() != AssetsConfig().key()
