"""Reading a local prompt file (jsonl, json, parquet) with HF `datasets`' packaged builders, and saying where a
bad one goes wrong: row numbers are 0-based indices of data rows (blank jsonl lines are not rows), with the
1-based line of a jsonl file. Only local files are read: never a hub id."""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

# File suffix -> HF `datasets` packaged builder.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_table(path: str, *, skip_unreadable: bool = False):
    """(table, row ids, unreadable rows) of a local file, read with HF `datasets`' packaged json/parquet builder
    (no hub access). Row ids is None when table row i is file row i; with skip_unreadable a jsonl file whose
    lines are not all JSON objects is read without them: row ids then map table rows to file rows, and the
    skipped ones come back as (row, reason)."""
    import datasets

    builder = BUILDERS[os.path.splitext(path)[1].lower()]
    kwargs: dict[str, Any] = {}
    if builder == "json" and _json_builder_has("on_mixed_types"):
        # The default, "use_json", stores a column that mixes JSON types as JSON text and json-decodes every
        # value on read: the string "8" comes back as the int 8, the prompt "null" as None. Keep types exact
        # and let such a file fail instead (_locate_json_problem then names the row).
        kwargs["on_mixed_types"] = None
    try:
        with quiet_datasets():
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
                        with quiet_datasets():
                            table = datasets.load_dataset(builder, data_files=clean, split="train", **kwargs)
                    except Exception:
                        detail = _locate_json_problem(path, skip=set(i for i, _ in unreadable))
                        raise ValueError(f"--prompt-data {path}: {detail or err}") from err
                    return table, keep, unreadable
        detail = _locate_json_problem(path) if builder == "json" else None
        raise ValueError(f"--prompt-data {path}: {detail or f'cannot be read as {builder}: {err}'}") from err


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """`datasets` without its progress bars and log lines for the duration: a file that fails to load is reported
    once, as our one line naming the row (its own error log and pyarrow's message would come first otherwise)."""
    from datasets.utils import logging as ds_logging

    verbosity, bars = ds_logging.get_verbosity(), ds_logging.is_progress_bar_enabled()
    ds_logging.set_verbosity(ds_logging.CRITICAL + 1)  # above every level: its load errors are ours to report
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars:
            ds_logging.enable_progress_bar()


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


def line_of_row(path: str, row: int) -> str:
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
                    f"row {row_idx} (0-based){where}: {key!r} holds {_a(kind)} but row {seen_row} holds "
                    f"{_a(seen_kind)}; "
                    "a column must hold one JSON type (this row cannot be skipped, fix it)"
                )
    return None


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"  # Arrow widens int to float within a column
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
