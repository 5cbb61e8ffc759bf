"""The character-level tokenizer (slime_sparse/tasks/tokenizer.py)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from slime_sparse.tasks.tokenizer import (
    BOS_TOKEN,
    DEFAULT_CHARSET,
    EOS_TOKEN,
    build_char_tokenizer,
    load_tokenizer,
    save_tokenizer,
)


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
