"""A character-level tokenizer, saved and loaded as an ordinary Hugging Face tokenizer directory.

Every character of `charset` is one token, so token counts equal character counts (a KV budget of
32 tokens is 32 characters of scratchpad). Encoding with special tokens prepends <s> (the usual
attention sink at position 0); a generated response is closed by </s>.
"""
from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0..3, in this order

# Digits and operators cover the default task; letters and a few symbols leave room for other tasks.
DEFAULT_CHARSET = string.digits + "+-*/=;:#,.()?<> " + string.ascii_lowercase


def build_char_tokenizer(charset: str = DEFAULT_CHARSET) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character of `charset` (unknown characters -> <unk>)."""
    if not charset:
        raise ValueError("charset must not be empty")
    if len(set(charset)) != len(charset):
        dupes = sorted({c for c in charset if charset.count(c) > 1})
        raise ValueError(f"charset has duplicate characters: {dupes!r}")

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab[ch] = len(vocab)

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split into single characters; "isolated" keeps every character (spaces included) as its own piece.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate pieces back without inserting spaces
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",  # decoder-only generation pads prompts on the left
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str | Path) -> Path:
    path = Path(path)
    tokenizer.save_pretrained(str(path))
    return path


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer directory written by `save_tokenizer` (local files only, never the hub)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer path {str(path)!r} has no tokenizer.json")
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
