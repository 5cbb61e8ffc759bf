"""Prompt loading (jsonl / parquet), tokenization, filtering, bad rows, and the resumable batch stream."""
from __future__ import annotations

import json
import logging

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from slime_sparse.data.prompt_dataset import DataConfig, PromptDataset, PromptStream

# A word-level vocabulary: every whitespace-separated word is one token, so expected ids are easy to write.
WORDS = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>"] + [str(d) for d in range(10)] + ["=", "+", "be", "brief"]
VOCAB = {w: i for i, w in enumerate(WORDS)}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def ids(text: str) -> list[int]:
    """Reference tokenization, by hand: one id per whitespace-separated word."""
    return [VOCAB[w] for w in text.split()]


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", chat_template=chat_template)


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def running_sum_rows(n: int) -> list[dict]:
    """n distinct prompts "a b =" with label str(a + b); row i has a = i % 10, b = i // 10."""
    return [{"prompt": f"{i % 10} {i // 10} =", "label": str(i % 10 + i // 10)} for i in range(n)]


def make_stream(tmp_path, n: int, batch_size: int, **cfg_kw) -> PromptStream:
    path = write_jsonl(tmp_path / "prompts.jsonl", running_sum_rows(n))
    return PromptStream(PromptDataset(DataConfig(prompt_data=path, **cfg_kw), make_tokenizer()), batch_size=batch_size)


# ----------------------------------------------------------------------------------------------- loading


def test_jsonl_plain_prompts_are_tokenized_in_file_order(tmp_path):
    rows = [
        {"prompt": "3 5 =", "label": "8"},
        {"prompt": "1 + 2 =", "label": "[1, 2]"},
        {"prompt": "0 =", "label": "null"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:]))  # a blank line
    ds = PromptDataset(DataConfig(prompt_data=str(path), shuffle=False), make_tokenizer())

    assert len(ds) == 3
    recs = ds.records()
    assert [r.prompt_ids for r in recs] == [[VOCAB["3"], VOCAB["5"], VOCAB["="]], ids("1 + 2 ="), ids("0 =")]
    assert [r.prompt_text for r in recs] == ["3 5 =", "1 + 2 =", "0 ="]
    assert [r.label for r in recs] == ["8", "[1, 2]", "null"]  # strings that look like JSON stay strings
    assert [r.index for r in recs] == [0, 1, 2] and [r.row for r in recs] == [0, 1, 2]
    assert ds.stats() == {
        "data/num_rows": 3, "data/num_prompts": 3, "data/skipped_too_long": 0, "data/skipped_bad_rows": 0
    }


def test_parquet_with_custom_keys_and_metadata(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "question": ["2 2 =", "9 =", "4 4 4 ="],
            "answer": ["4", "9", "12"],
            "meta": [{"source": "a", "level": 1}, {"source": "b", "level": 2}, None],
        }
    )
    path = str(tmp_path / "p.parquet")
    pq.write_table(table, path)
    cfg = DataConfig(prompt_data=path, input_key="question", label_key="answer", metadata_key="meta")
    ds = PromptDataset(cfg, make_tokenizer())

    assert [p.prompt_ids for p in ds.prompts] == [ids("2 2 ="), ids("9 ="), ids("4 4 4 =")]
    assert [p.label for p in ds.prompts] == ["4", "9", "12"]
    assert [p.metadata for p in ds.prompts] == [{"source": "a", "level": 1}, {"source": "b", "level": 2}, {}]


def test_no_label_key_gives_none_labels(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1 ="}])
    ds = PromptDataset(DataConfig(prompt_data=path, label_key=None), make_tokenizer())
    assert ds[0].label is None


def test_chat_template_on_string_prompts(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "3 5 =", "label": "8"}])
    ds = PromptDataset(DataConfig(prompt_data=path, apply_chat_template=True), make_tokenizer())

    expected = "<|user|> 3 5 = <|assistant|>"  # the template rendered by hand, generation prompt appended
    assert ds[0].prompt_text == expected
    assert ds[0].prompt_ids == ids(expected)


def test_chat_template_on_message_list_prompts(tmp_path):
    rows = [
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 1 ="}], "label": "2"},
        {"prompt": [{"role": "user", "content": "4 ="}], "label": "4"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    ds = PromptDataset(DataConfig(prompt_data=path, apply_chat_template=True), make_tokenizer())

    expected = ["<|system|> be brief <|user|> 1 1 = <|assistant|>", "<|user|> 4 = <|assistant|>"]
    assert [p.prompt_text for p in ds.prompts] == expected
    assert [p.prompt_ids for p in ds.prompts] == [ids(t) for t in expected]


def test_malformed_message_is_a_bad_row(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "1 ="}], "label": "1"},
        {"prompt": [{"role": "user"}], "label": "2"},  # no content
        {"prompt": [], "label": "3"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match="row 1 \\(0-based\\), line 2: --input-key 'prompt' message 0 must be a dict"):
        PromptDataset(DataConfig(prompt_data=path, apply_chat_template=True), make_tokenizer())
    ds = PromptDataset(DataConfig(prompt_data=path, apply_chat_template=True, skip_bad_rows=True), make_tokenizer())
    assert [p.row for p in ds.prompts] == [0] and ds.num_skipped_bad == 2


def test_chat_template_requested_without_one_names_the_flag(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1 =", "label": "1"}])
    with pytest.raises(ValueError, match="--apply-chat-template"):
        PromptDataset(DataConfig(prompt_data=path, apply_chat_template=True), make_tokenizer(chat_template=None))


def test_overlong_prompts_are_skipped_and_counted(tmp_path, caplog):
    rows = [{"prompt": " ".join(["1"] * n), "label": str(n)} for n in (2, 3, 4, 5, 1)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="slime_sparse.data.prompt_dataset"):
        ds = PromptDataset(DataConfig(prompt_data=path, max_prompt_len=3), make_tokenizer())

    assert [p.label for p in ds.prompts] == ["2", "3", "1"]  # lengths 2, 3 and 1 fit; 4 and 5 do not
    assert [p.row for p in ds.prompts] == [0, 1, 4]
    assert ds.num_skipped_too_long == 2
    assert ds.stats()["data/skipped_too_long"] == 2
    assert "2 over --rollout-max-prompt-len=3" in caplog.text


@pytest.mark.parametrize(
    "bad_row, reason",
    [
        ({"label": "1"}, "missing or null"),  # no prompt key
        ({"prompt": "   ", "label": "1"}, "empty string"),
        ({"prompt": "1 ="}, "--label-key 'label' is missing"),
    ],
)
def test_malformed_row_names_file_and_row_or_is_skipped(tmp_path, bad_row, reason):
    rows = [{"prompt": "1 =", "label": "1"}, {"prompt": "2 =", "label": "2"}, bad_row, {"prompt": "3 =", "label": "3"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError) as err:
        PromptDataset(DataConfig(prompt_data=path), make_tokenizer())
    assert path in str(err.value) and "row 2 (0-based)" in str(err.value) and reason in str(err.value)

    ds = PromptDataset(DataConfig(prompt_data=path, skip_bad_rows=True), make_tokenizer())
    assert [p.label for p in ds.prompts] == ["1", "2", "3"]
    assert [p.row for p in ds.prompts] == [0, 1, 3]
    assert ds.num_skipped_bad == 1


def test_wrong_type_in_a_uniformly_typed_column_is_a_bad_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": 12, "label": "1"}, {"prompt": 3, "label": "2"}])
    with pytest.raises(ValueError, match="row 0 \\(0-based\\), line 1: .*must be a string or a list of messages, got int"):
        PromptDataset(DataConfig(prompt_data=path), make_tokenizer())


@pytest.mark.parametrize("skip_bad_rows", [False, True])
def test_row_mixing_json_types_names_row_and_line(tmp_path, skip_bad_rows):
    """A number among string prompts: Arrow cannot hold both in one column, so the load fails with the row
    named, even with skip_bad_rows (and never by silently converting values)."""
    rows = [{"prompt": "1 =", "label": "1"}, {"prompt": "2 =", "label": "2"}, {"prompt": 5, "label": "3"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError) as err:
        PromptDataset(DataConfig(prompt_data=path, skip_bad_rows=skip_bad_rows), make_tokenizer())
    msg = str(err.value)
    assert path in msg and "row 2 (0-based), line 3" in msg and "'prompt' holds a number" in msg

    labels = [{"prompt": "1 =", "label": "8"}, {"prompt": "2 =", "label": 3}]
    path = write_jsonl(tmp_path / "labels.jsonl", labels)
    with pytest.raises(ValueError, match="row 1 \\(0-based\\), line 2: 'label' holds a number"):
        PromptDataset(DataConfig(prompt_data=path), make_tokenizer())


def test_message_list_without_chat_template_is_a_bad_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "1 ="}], "label": "1"}])
    with pytest.raises(ValueError, match="row 0 .*set --apply-chat-template"):
        PromptDataset(DataConfig(prompt_data=path), make_tokenizer())


def test_absent_columns_and_unreadable_files_name_the_flag(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "1 =", "label": "1"}])
    with pytest.raises(ValueError, match="--input-key 'prompt' is not a column"):
        PromptDataset(DataConfig(prompt_data=path), make_tokenizer())
    with pytest.raises(ValueError, match="--label-key 'answer' is not a column"):
        PromptDataset(DataConfig(prompt_data=path, input_key="question", label_key="answer"), make_tokenizer())

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1 =", "label": "1"}\n{"prompt": "2", "label"\n', encoding="utf-8")
    with pytest.raises(ValueError, match="--prompt-data .*broken.jsonl: row 1 \\(0-based\\), line 2: not valid JSON"):
        PromptDataset(DataConfig(prompt_data=str(broken)), make_tokenizer())


def test_all_rows_filtered_out_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1 2 3 4", "label": "1"}])
    with pytest.raises(ValueError, match="no usable prompt .*1 over --rollout-max-prompt-len"):
        PromptDataset(DataConfig(prompt_data=path, max_prompt_len=2), make_tokenizer())


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"prompt_data": "does/not/exist.jsonl"}, "--prompt-data"),
        ({"prompt_data": "org/some-hub-dataset"}, "--prompt-data"),  # a hub id is not a local file
        ({"input_key": ""}, "--input-key"),
        ({"label_key": ""}, "--label-key"),
        ({"apply_chat_template": "yes"}, "--apply-chat-template"),
        ({"max_prompt_len": 0}, "--rollout-max-prompt-len"),
        ({"shuffle": 1}, "--rollout-shuffle"),
        ({"seed": -1}, "--rollout-seed"),
        ({"num_epochs": 0}, "--num-epoch"),
    ],
)
def test_config_validation_names_the_flag(tmp_path, overrides, flag):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1 =", "label": "1"}])
    cfg = DataConfig(**{"prompt_data": path, **overrides})
    with pytest.raises(ValueError, match=flag):
        cfg.validate()
        cfg.check_inputs()  # the file itself: checked at start-up, not when the config is built


# ----------------------------------------------------------------------------------------------- stream


def test_unshuffled_stream_carries_batches_over_epoch_boundaries(tmp_path):
    stream = make_stream(tmp_path, n=5, batch_size=2, shuffle=False, num_epochs=2)
    assert stream.num_batches == 5
    batches = list(stream)

    assert len(batches) == 5
    flat = [r for b in batches for r in b]
    assert [r.index for r in flat] == list(range(10))
    assert [r.row for r in flat] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert [r.epoch for r in flat] == [0] * 5 + [1] * 5
    assert [(r.row, r.epoch) for r in batches[2]] == [(4, 0), (0, 1)]  # the batch spanning the boundary
    assert flat[7].prompt_ids == ids("2 0 =") and flat[7].label == "2"


def test_trailing_partial_batch_is_not_iterated_but_next_batch_continues(tmp_path):
    stream = make_stream(tmp_path, n=5, batch_size=2, shuffle=False, num_epochs=1)
    assert stream.num_batches == 2  # 5 // 2: prompt row 4 is the partial remainder
    assert [[r.row for r in b] for b in stream] == [[0, 1], [2, 3]]
    assert stream.batches_left == 0 and list(stream) == []
    # More rollouts than --num-epoch holds: the stream goes on into epoch 1, as slime's data source does.
    assert [(r.index, r.row, r.epoch) for r in stream.next_batch()] == [(4, 4, 0), (5, 0, 1)]


def test_batch_larger_than_dataset_spans_epochs(tmp_path):
    stream = make_stream(tmp_path, n=3, batch_size=4, shuffle=True, num_epochs=4)
    flat = [r for b in stream for r in b]
    assert len(flat) == 12  # 4 * 3 // 4 = 3 batches of 4
    assert [r.epoch for r in flat] == [i // 3 for i in range(12)]
    for e in range(4):
        assert sorted(r.row for r in flat if r.epoch == e) == [0, 1, 2]


def test_shuffle_is_a_deterministic_per_epoch_permutation(tmp_path):
    n = 20
    rows = lambda stream: [r.row for b in stream for r in b]  # noqa: E731
    a = rows(make_stream(tmp_path, n=n, batch_size=4, seed=7, num_epochs=2))
    b = rows(make_stream(tmp_path, n=n, batch_size=5, seed=7, num_epochs=2))  # batching does not change order
    c = rows(make_stream(tmp_path, n=n, batch_size=4, seed=8, num_epochs=2))

    assert a == b
    assert a != c
    epoch0, epoch1 = a[:n], a[n:]
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))  # each epoch sees every row once
    assert epoch0 != list(range(n))  # shuffled (identity has probability 1/20!)
    assert epoch0 != epoch1  # reshuffled per epoch


def test_resume_continues_exactly(tmp_path):
    """5 batches straight == 2 batches, save, fresh stream, load, 3 batches (crossing epoch boundaries)."""
    kw = dict(n=7, batch_size=3, seed=3, num_epochs=3)
    key = lambda b: [(r.index, r.row, r.epoch, tuple(r.prompt_ids), r.label) for r in b]  # noqa: E731

    straight = make_stream(tmp_path, **kw)
    expected = [key(straight.next_batch()) for _ in range(5)]

    first = make_stream(tmp_path, **kw)
    got = [key(first.next_batch()) for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))  # as it travels through a checkpoint
    resumed = make_stream(tmp_path, **kw)
    resumed.load_state_dict(state)
    got += [key(resumed.next_batch()) for _ in range(3)]

    assert got == expected
    assert [i for b in got for (i, *_rest) in b] == list(range(15))  # nothing repeated or lost
    assert resumed.batches_left == 7 - 5


def test_resume_refuses_a_different_order(tmp_path):
    state = make_stream(tmp_path, n=7, batch_size=3, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed: checkpoint 3 vs now 4"):
        make_stream(tmp_path, n=7, batch_size=3, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts: checkpoint 7 vs now 8"):
        make_stream(tmp_path, n=8, batch_size=3, seed=3).load_state_dict(state)
    # The batch size may change: the position is counted in prompts.
    make_stream(tmp_path, n=7, batch_size=2, seed=3).load_state_dict(state)


def test_records_are_copies(tmp_path):
    stream = make_stream(tmp_path, n=2, batch_size=2, shuffle=False, num_epochs=2)
    first = stream.next_batch()
    first[0].prompt_ids.append(999)
    assert stream.next_batch()[0].prompt_ids == ids("0 0 =")


def test_unreadable_line_names_file_row_and_line_or_is_skipped(tmp_path):
    lines = ['{"prompt": "1 =", "label": "1"}', "", '{"prompt": "2 =", "label": "2"}', '{"prompt": "3 =", "la',
             "[1, 2]", '{"prompt": "4 =", "label": "4"}']
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl: row 2 \(0-based\), line 4: not valid JSON"):
        PromptDataset(DataConfig(prompt_data=str(path)), make_tokenizer())

    ds = PromptDataset(DataConfig(prompt_data=str(path), skip_bad_rows=True), make_tokenizer())
    assert [p.label for p in ds.prompts] == ["1", "2", "4"]
    assert [p.row for p in ds.prompts] == [0, 1, 4]  # rows of the file, not of what was left
    assert ds.num_skipped_bad == 2 and ds.num_rows == 5


def test_bad_row_names_its_jsonl_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1 =", "label": "1"}\n\n\n{"prompt": "", "label": "2"}\n')
    with pytest.raises(ValueError, match=r"row 1 \(0-based\), line 4: --input-key 'prompt' is an empty string"):
        PromptDataset(DataConfig(prompt_data=str(path)), make_tokenizer())
