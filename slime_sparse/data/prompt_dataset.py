"""Prompt data for rollouts: a local jsonl/parquet file -> tokenized prompts -> a resumable batch stream.

The knobs mirror slime's flags (--prompt-data, --input-key, --label-key, --apply-chat-template,
--rollout-max-prompt-len, --rollout-shuffle, --rollout-seed, --num-epoch) and the stream follows slime's data
source: prompts are consumed in a per-epoch order, and a batch that reaches the end of an epoch is completed
with the first prompts of the next epoch (carry-over), so no prompt is dropped at epoch boundaries.

Row numbers in error messages are 0-based indices of data rows (blank jsonl lines are not rows), with the
1-based line of a jsonl file. Rows that are malformed one by one (a line that is not a JSON object,
missing/null/empty prompt or label, bad messages) raise or, with skip_bad_rows (`--skip-bad-rows`), are
skipped and counted. A column must hold one JSON type, though (Arrow's rule): a row that breaks it, e.g. a
number among string prompts, fails the whole load with its row and line named, even with skip_bad_rows;
we turn off `datasets`' fallback for such files because it silently re-types values.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

logger = logging.getLogger(__name__)

# File suffix -> HF `datasets` packaged builder. Only local files are read: never a hub id.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

_STATE_VERSION = 1


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
        if self.prompt_data and suffix not in _BUILDERS:
            raise ValueError(
                f"--prompt-data {self.prompt_data!r}: unsupported file type {suffix!r}, "
                f"expected one of {sorted(_BUILDERS)}"
            )
        if not isinstance(self.input_key, str) or not self.input_key:
            raise ValueError(f"--input-key must be a non-empty string, got {self.input_key!r}")
        if self.label_key is not None and (not isinstance(self.label_key, str) or not self.label_key):
            raise ValueError(f"--label-key must be a non-empty string or None, got {self.label_key!r}")
        if self.metadata_key is not None and (not isinstance(self.metadata_key, str) or not self.metadata_key):
            raise ValueError(f"--metadata-key must be a non-empty string or None, got {self.metadata_key!r}")
        if not isinstance(self.apply_chat_template, bool):
            raise ValueError(f"--apply-chat-template must be a bool, got {self.apply_chat_template!r}")
        if self.max_prompt_len is not None and (not _is_int(self.max_prompt_len) or self.max_prompt_len < 1):
            raise ValueError(f"--rollout-max-prompt-len must be a positive int or None, got {self.max_prompt_len!r}")
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"--rollout-shuffle must be a bool, got {self.shuffle!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"--rollout-seed must be a non-negative int, got {self.seed!r}")
        if not _is_int(self.num_epochs) or self.num_epochs < 1:
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


@dataclass(frozen=True)
class PromptRecord:
    """A prompt as the stream hands it out."""

    index: int  # global stream position: epoch * len(dataset) + position in that epoch; unique across epochs
    prompt_ids: list[int]
    prompt_text: str
    label: Any
    metadata: dict
    epoch: int
    row: int  # 0-based data row in the source file


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

        table, row_ids, unreadable = _load_table(cfg.prompt_data, skip_unreadable=cfg.skip_bad_rows)
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
        return f"--prompt-data {path}: row {row_idx} (0-based){_line_of_row(path, row_idx)}"

    def _skip_bad_row(self, row_idx: int, reason: str) -> None:
        if self.num_skipped_bad < 5:  # a few examples are enough to diagnose a bad file
            logger.warning("skipping %s: %s", self._where(row_idx), reason)
        self.num_skipped_bad += 1

    def records(self) -> list[PromptRecord]:
        """Every prompt once, in file order (index = position in the dataset): for evaluation."""
        return [_record(p, index=i, epoch=0) for i, p in enumerate(self.prompts)]

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


class PromptStream:
    """Batches of `batch_size` (--rollout-batch-size) prompts, epoch after epoch, resumable per prompt.

    Epoch e visits every prompt once, in the order of a permutation drawn from an RNG seeded by
    (cfg.seed, e) (dataset order when cfg.shuffle is False). Batches carry over epoch boundaries: a batch
    that reaches the end of epoch e is completed with the first prompts of epoch e + 1.

    `num_batches = num_epochs * len(dataset) // batch_size` is the rollout count that --num-epoch stands
    for (slime's default --num-rollout); iterating the stream yields exactly the batches left of it, so
    the last `num_epochs * len(dataset) % batch_size` prompts (less than a batch) are not handed out.
    `next_batch()` itself never runs dry: past the --num-epoch budget it keeps going with fresh epochs,
    as slime does when --num-rollout asks for more rollouts than the epochs hold.

    The position is one counter, `consumed` (prompts handed out so far); `state_dict()` stores it with the
    settings that fix the order, and `load_state_dict()` refuses a state whose order would differ, so a
    resumed run continues with no prompt repeated or lost.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int) -> None:
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"--rollout-batch-size must be an int >= 1, got {batch_size!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = dataset.cfg.shuffle
        self.seed = dataset.cfg.seed
        self.num_epochs = dataset.cfg.num_epochs
        self.consumed = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(0)

    @property
    def num_batches(self) -> int:
        """Full batches in --num-epoch epochs."""
        return self.num_epochs * len(self.dataset) // self.batch_size

    @property
    def batches_left(self) -> int:
        """Full batches left of the --num-epoch budget."""
        return max(0, self.num_epochs * len(self.dataset) - self.consumed) // self.batch_size

    @property
    def epoch(self) -> int:
        """Epoch of the next prompt to be handed out."""
        return self.consumed // len(self.dataset)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset positions in the order epoch `epoch` visits them."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        # Seeding with the pair (seed, epoch) gives independent streams: (1, 1) and (2, 0) never collide.
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self, size: int | None = None) -> list[PromptRecord]:
        """The next `size` prompts (default `batch_size`; possibly spanning an epoch boundary)."""
        size = self.batch_size if size is None else size
        n = len(self.dataset)
        batch = []
        for index in range(self.consumed, self.consumed + size):
            epoch, pos = divmod(index, n)
            if epoch != self._order_epoch:
                if epoch == self.num_epochs and pos == 0:
                    logger.info("prompt stream: --num-epoch=%d done, starting epoch %d", self.num_epochs, epoch)
                self._order, self._order_epoch = self.epoch_order(epoch), epoch
            p = self.dataset[int(self._order[pos])]
            batch.append(_record(p, index=index, epoch=epoch))
        self.consumed += size
        return batch

    def put_back(self, count: int) -> None:
        """Return the last `count` prompts handed out: the next batch starts with them, same order and indices
        (dynamic sampling gives back the groups a rollout generated but did not need)."""
        if not _is_int(count) or not 0 <= count <= self.consumed:
            raise ValueError(f"cannot put back {count!r} prompts: {self.consumed} were handed out")
        self.consumed -= count

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        """The batches left of the --num-epoch budget."""
        for _ in range(self.batches_left):
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position of the stream."""
        return {
            "version": _STATE_VERSION,
            "consumed": self.consumed,
            "num_prompts": len(self.dataset),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`. The batch size and epoch count may change; the prompt order may not."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')!r} is not {_STATE_VERSION}")
        expected = {"num_prompts": len(self.dataset), "shuffle": self.shuffle, "seed": self.seed}
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed:
            details = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in changed.items())
            raise ValueError(
                "cannot resume the prompt stream: the prompt order would differ "
                f"({details}); keep --prompt-data, --rollout-max-prompt-len, --rollout-shuffle and --rollout-seed"
            )
        consumed = state.get("consumed")
        if not _is_int(consumed) or consumed < 0:
            raise ValueError(f"data state 'consumed' must be a non-negative int, got {consumed!r}")
        self.consumed = consumed


def _record(p: Prompt, *, index: int, epoch: int) -> PromptRecord:
    # Copies: a caller editing a record's ids or metadata must not change the dataset for later epochs.
    return PromptRecord(
        index=index,
        prompt_ids=list(p.prompt_ids),
        prompt_text=p.prompt_text,
        label=p.label,
        metadata=dict(p.metadata),
        epoch=epoch,
        row=p.row,
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _load_table(path: str, *, skip_unreadable: bool = False):
    """(table, row ids, unreadable rows) of a local file, read with HF `datasets`' packaged json/parquet builder
    (no hub access). Row ids is None when table row i is file row i; with skip_unreadable a jsonl file whose
    lines are not all JSON objects is read without them: row ids then map table rows to file rows, and the
    skipped ones come back as (row, reason)."""
    import datasets

    builder = _BUILDERS[os.path.splitext(path)[1].lower()]
    kwargs: dict[str, Any] = {}
    if builder == "json" and _json_builder_has("on_mixed_types"):
        # The default, "use_json", stores a column that mixes JSON types as JSON text and json-decodes every
        # value on read: the string "8" comes back as the int 8, the prompt "null" as None. Keep types exact
        # and let such a file fail instead (_locate_json_problem then names the row).
        kwargs["on_mixed_types"] = None
    try:
        return datasets.load_dataset(builder, data_files=os.path.abspath(path), split="train", **kwargs), None, []
    except Exception as err:  # datasets wraps parse errors in its own types; name the flag, file and row
        if builder == "json" and skip_unreadable:
            rows, unreadable = _read_jsonl_objects(path)
            if unreadable and rows:
                keep = [i for i, _ in rows]
                # the readable rows go through the same builder (and the same one-type-per-column check)
                with tempfile.TemporaryDirectory() as tmp:
                    clean = os.path.join(tmp, "rows.jsonl")
                    with open(clean, "w", encoding="utf-8") as fh:
                        fh.writelines(json.dumps(r) + "\n" for _, r in rows)
                    try:
                        table = datasets.load_dataset(builder, data_files=clean, split="train", **kwargs)
                    except Exception:
                        detail = _locate_json_problem(path, skip=set(i for i, _ in unreadable))
                        raise ValueError(f"--prompt-data {path}: {detail or err}") from err
                    return table, keep, unreadable
        detail = _locate_json_problem(path) if builder == "json" else None
        raise ValueError(f"--prompt-data {path}: {detail or f'cannot be read as {builder}: {err}'}") from err


def _read_jsonl_objects(path: str) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    """(row, object) of each line of a JSON Lines file that holds a JSON object, and (row, why) of the others."""
    rows, unreadable = [], []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = len(rows) + len(unreadable)
            try:
                value = json.loads(line)
            except ValueError as err:
                unreadable.append((row, f"not valid JSON ({err})"))
                continue
            if isinstance(value, dict):
                rows.append((row, value))
            else:
                unreadable.append((row, "not a JSON object"))
    return rows, unreadable


def _line_of_row(path: str, row: int) -> str:
    """", line N" (1-based) of data row `row` of a JSON Lines file (blank lines are not rows); "" for other files."""
    if os.path.splitext(path)[1].lower() != ".jsonl":
        return ""
    with open(path, encoding="utf-8") as fh:
        seen = -1
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                seen += 1
                if seen == row:
                    return f", line {lineno}"
    return ""


def _json_builder_has(option: str) -> bool:
    try:
        from datasets.packaged_modules.json.json import JsonConfig
    except ImportError:
        return False
    return option in getattr(JsonConfig, "__dataclass_fields__", {})


def _locate_json_problem(path: str, skip: set[int] = frozenset()) -> str | None:
    """Why a json/jsonl file failed to load: its first invalid line, or the first row where a key holds a
    different JSON type than in earlier rows (Arrow needs one type per column, so such a row cannot be
    skipped either). None when neither applies. `skip`: jsonl rows to leave out (already reported)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        whole = json.loads(text)  # a .json file holding one array of rows
    except ValueError:
        whole = None
    if isinstance(whole, list):
        rows = [(i, "", r) for i, r in enumerate(whole)]
    else:  # JSON Lines; blank lines are not rows
        rows, row = [], -1
        for lineno, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            row += 1
            if row in skip:
                continue
            try:
                rows.append((row, f", line {lineno}", json.loads(line)))
            except ValueError as err:
                return f"row {row} (0-based), line {lineno}: not valid JSON ({err})"

    first_kind: dict[str, tuple[str, int]] = {}
    for row_idx, where, row in rows:
        if not isinstance(row, dict):
            return f"row {row_idx} (0-based){where}: not a JSON object"
        for key, value in row.items():
            if value is None:
                continue
            kind = _json_kind(value)
            seen_kind, seen_row = first_kind.setdefault(key, (kind, row_idx))
            if kind != seen_kind:
                return (
                    f"row {row_idx} (0-based){where}: {key!r} holds a {kind} but row {seen_row} holds a {seen_kind}; "
                    "a column must hold one JSON type (this row cannot be skipped, fix it)"
                )
    return None


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"  # Arrow widens int to float within a column
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


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
