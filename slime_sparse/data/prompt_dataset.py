"""Prompt data for rollouts: a local jsonl/parquet file (files.py) -> tokenized prompts -> a resumable batch
stream (stream.py).

The knobs mirror slime's flags (--prompt-data, --input-key, --label-key, --apply-chat-template,
--rollout-max-prompt-len, --rollout-shuffle, --rollout-seed, --num-epoch).

Row numbers in error messages are 0-based indices of data rows (blank jsonl lines are not rows), with the
1-based line of a jsonl file. Rows that are malformed one by one (a line that is not a JSON object,
missing/null/empty prompt or label, bad messages) raise or, with skip_bad_rows (`--skip-bad-rows`), are
skipped and counted. A column must hold one JSON type, though (Arrow's rule): a row that breaks it, e.g. a
number among string prompts, fails the whole load with its row and line named, even with skip_bad_rows;
we turn off `datasets`' fallback for such files because it silently re-types values.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from .files import BUILDERS, line_of_row, load_table
from .stream import PromptRecord, PromptStream, is_int, record_of

__all__ = ["DataConfig", "Prompt", "PromptDataset", "PromptRecord", "PromptStream"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataConfig:
    prompt_data: str = field(default="", metadata={"help": "local .jsonl / .json / .parquet file of prompts; required"})
    input_key: str = field(default="prompt", metadata={"help": (
        "the prompt column: a string, or a list of {role, content} messages (slime's default: input; prompt here, "
        "the column of DAPO-Math-17k and of our tasks)")})
    label_key: str | None = field(default="label", metadata={"help": (
        "the label column, None when rows carry none (slime's default: none; label here, what slime's scripts pass)")})
    apply_chat_template: bool = field(default=False, metadata={"help": (
        "render each prompt with the tokenizer's chat template (needed for message-list prompts)")})
    max_prompt_len: int | None = field(default=None, metadata={"help": (
        "prompts longer than this (tokens) are skipped and counted; unset: none skipped")})
    shuffle: bool = field(default=True, metadata={"help": (
        "shuffle the prompts each epoch (--no-rollout-shuffle: file order). slime's default is off; on here, as every "
        "slime GRPO script passes it: in file order the first rollouts see only what the file starts with")})
    seed: int = field(default=42, metadata={"help": "epoch e is shuffled with the RNG seeded by (seed, e)"})
    skip_bad_rows: bool = field(default=False, metadata={"help": (
        "skip (and count, data/skipped_bad_rows) malformed rows instead of stopping at the first")})
    num_epochs: int = field(default=1, metadata={"help": (
        "passes over --prompt-data the run may make; --num-rollout batches must fit in them (slime computes "
        "--num-rollout from it when that is unset, and otherwise loops over the data)")})
    metadata_key: str | None = field(default=None, metadata={"help": (
        "a dict column passed through to the records; slime's default is metadata (read when present), none here: "
        "a named column must be in every row")})

    def validate(self) -> None:
        """Raise ValueError naming the offending flag. An unset --prompt-data is valid here (a config of defaults);
        a run requires it (slime_sparse.startup)."""
        if not isinstance(self.prompt_data, str):
            raise ValueError(f"--prompt-data must be a path to a local file, got {self.prompt_data!r}")
        suffix = os.path.splitext(self.prompt_data)[1].lower()
        if self.prompt_data and suffix not in BUILDERS:
            raise ValueError(
                f"--prompt-data {self.prompt_data!r}: unsupported file type {suffix!r}, "
                f"expected one of {sorted(BUILDERS)}"
            )
        if not isinstance(self.input_key, str) or not self.input_key:
            raise ValueError(f"--input-key must be a non-empty string, got {self.input_key!r}")
        if self.label_key is not None and (not isinstance(self.label_key, str) or not self.label_key):
            raise ValueError(f"--label-key must be a non-empty string or None, got {self.label_key!r}")
        if self.metadata_key is not None and (not isinstance(self.metadata_key, str) or not self.metadata_key):
            raise ValueError(f"--metadata-key must be a non-empty string or None, got {self.metadata_key!r}")
        if not isinstance(self.apply_chat_template, bool):
            raise ValueError(f"--apply-chat-template must be a bool, got {self.apply_chat_template!r}")
        if self.max_prompt_len is not None and (not is_int(self.max_prompt_len) or self.max_prompt_len < 1):
            raise ValueError(f"--rollout-max-prompt-len must be a positive int or None, got {self.max_prompt_len!r}")
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"--rollout-shuffle must be a bool, got {self.shuffle!r}")
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"--rollout-seed must be a non-negative int, got {self.seed!r}")
        if not is_int(self.num_epochs) or self.num_epochs < 1:
            raise ValueError(f"--num-epoch must be an int >= 1, got {self.num_epochs!r}")

    def check_inputs(self) -> None:
        """--prompt-data is a local file (checked at start-up, not when the config is built)."""
        if not self.prompt_data:
            raise ValueError(f"--prompt-data must be a path to a local file, got {self.prompt_data!r}")
        if not os.path.isfile(self.prompt_data):
            raise ValueError(f"--prompt-data {self.prompt_data!r} does not exist (only local files are read)")


@dataclass(frozen=True)
class Prompt:
    """One usable row of the prompt file, tokenized."""

    row: int  # 0-based data row in the source file
    prompt_ids: list[int]
    prompt_text: str  # the exact text that was tokenized (after the chat template, if applied)
    label: Any
    metadata: dict = field(default_factory=dict)


class _BadRow(Exception):
    """A row that cannot become a prompt; the message says why."""


class PromptDataset:
    """All usable prompts of `cfg.prompt_data`, tokenized once at construction.

    tokenizer: a HF tokenizer (callable returning {"input_ids": ...}; `apply_chat_template` when
    cfg.apply_chat_template). Without the chat template a string prompt is tokenized with the tokenizer's
    default special tokens (BOS for Llama, none for Qwen); with it, the rendered template already holds
    them, so it is tokenized with add_special_tokens=False.

    Counters: `num_skipped_too_long` (over cfg.max_prompt_len) and `num_skipped_bad` (malformed rows, only
    when cfg.skip_bad_rows; otherwise the first malformed row raises ValueError naming file and row).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any) -> None:
        cfg.validate()
        cfg.check_inputs()
        if cfg.apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("--apply-chat-template is set but the tokenizer has no chat_template")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.num_rows = 0
        self.num_skipped_too_long = 0
        self.num_skipped_bad = 0
        self.prompts: list[Prompt] = []

        table, row_ids, unreadable = load_table(cfg.prompt_data, skip_unreadable=cfg.skip_bad_rows)
        _check_columns(table.column_names, cfg)
        self.num_rows = len(table) + len(unreadable)
        for row_idx, reason in unreadable:  # lines that are not JSON objects (only with skip_bad_rows)
            self._skip_bad_row(row_idx, reason)
        for i, row in enumerate(table):
            row_idx = row_ids[i] if row_ids is not None else i
            try:
                prompt = self._parse_row(row_idx, row)
            except _BadRow as err:
                if not cfg.skip_bad_rows:
                    raise ValueError(f"{self._where(row_idx)}: {err}") from None
                self._skip_bad_row(row_idx, str(err))
                continue
            if cfg.max_prompt_len is not None and len(prompt.prompt_ids) > cfg.max_prompt_len:
                self.num_skipped_too_long += 1
                continue
            self.prompts.append(prompt)

        self._log_summary()
        if not self.prompts:
            raise ValueError(
                f"--prompt-data {cfg.prompt_data}: no usable prompt among {self.num_rows} rows "
                f"({self.num_skipped_too_long} over --rollout-max-prompt-len, {self.num_skipped_bad} malformed)"
            )

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def _where(self, row_idx: int) -> str:
        path = self.cfg.prompt_data
        return f"--prompt-data {path}: row {row_idx} (0-based){line_of_row(path, row_idx)}"

    def _skip_bad_row(self, row_idx: int, reason: str) -> None:
        if self.num_skipped_bad < 5:  # a few examples are enough to diagnose a bad file
            logger.warning("skipping %s: %s", self._where(row_idx), reason)
        self.num_skipped_bad += 1

    def records(self) -> list[PromptRecord]:
        """Every prompt once, in file order (index = position in the dataset): for evaluation."""
        return [record_of(p, index=i, epoch=0) for i, p in enumerate(self.prompts)]

    def stats(self) -> dict[str, int]:
        """Counters for the metrics log."""
        return {
            "data/num_rows": self.num_rows,
            "data/num_prompts": len(self.prompts),
            "data/skipped_too_long": self.num_skipped_too_long,
            "data/skipped_bad_rows": self.num_skipped_bad,
        }

    def _parse_row(self, row_idx: int, row: dict[str, Any]) -> Prompt:
        cfg = self.cfg
        value = row.get(cfg.input_key)
        if value is None:
            raise _BadRow(f"--input-key {cfg.input_key!r} is missing or null")
        if isinstance(value, str):
            if not value.strip():
                raise _BadRow(f"--input-key {cfg.input_key!r} is an empty string")
            messages = [{"role": "user", "content": value}]
        elif isinstance(value, list):
            messages = _check_messages(value, cfg.input_key)
            if not cfg.apply_chat_template:
                raise _BadRow(f"--input-key {cfg.input_key!r} is a list of messages: set --apply-chat-template")
        else:
            raise _BadRow(
                f"--input-key {cfg.input_key!r} must be a string or a list of messages, got {type(value).__name__}"
            )

        label = None
        if cfg.label_key is not None:
            label = row.get(cfg.label_key)
            if label is None:
                raise _BadRow(f"--label-key {cfg.label_key!r} is missing or null")

        metadata: dict = {}
        if cfg.metadata_key is not None:
            raw = row.get(cfg.metadata_key)
            if raw is not None and not isinstance(raw, dict):
                raise _BadRow(f"--metadata-key {cfg.metadata_key!r} must be a dict, got {type(raw).__name__}")
            metadata = dict(raw or {})

        # Tokenize last: a row that fails a cheaper check above costs nothing.
        if cfg.apply_chat_template:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = value
            ids = self.tokenizer(text)["input_ids"]

        return Prompt(row=row_idx, prompt_ids=list(ids), prompt_text=text, label=label, metadata=metadata)

    def _log_summary(self) -> None:
        msg = "loaded %d prompts from %s (%d rows; %d over --rollout-max-prompt-len=%s; %d malformed skipped)"
        args = (
            len(self.prompts),
            self.cfg.prompt_data,
            self.num_rows,
            self.num_skipped_too_long,
            self.cfg.max_prompt_len,
            self.num_skipped_bad,
        )
        if self.num_skipped_too_long or self.num_skipped_bad:
            logger.warning(msg, *args)
        else:
            logger.info(msg, *args)


def _check_columns(columns: list[str], cfg: DataConfig) -> None:
    """A key absent from the whole file is a configuration error, not a bad row."""
    keys = (("--input-key", cfg.input_key), ("--label-key", cfg.label_key), ("--metadata-key", cfg.metadata_key))
    for flag, key in keys:
        if key is not None and key not in columns:
            raise ValueError(f"{flag} {key!r} is not a column of --prompt-data {cfg.prompt_data} (columns: {columns})")


def _check_messages(value: list, input_key: str) -> list[dict[str, str]]:
    if not value:
        raise _BadRow(f"--input-key {input_key!r} is an empty list of messages")
    messages = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _BadRow(f"--input-key {input_key!r} message {j} must be a dict with string 'role' and 'content'")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in messages):
        raise _BadRow(f"--input-key {input_key!r}: every message is empty")
    return messages
