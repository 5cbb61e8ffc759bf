"""Run logging: metrics.jsonl (the record plots are made from), TensorBoard, optional Weights & Biases, and
progress bars that turn into periodic log lines when stderr is not a terminal (CI logs).

metrics.jsonl holds one JSON object per `log()` call: {"step": int, "time": unix seconds, "<key>": number
or null, ...}. Several calls may share a step (e.g. rollout metrics, then eval metrics). Non-finite numbers
are written as null, counted and warned about, never raised: a NaN in one metric must not end a run.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

from slime_sparse.utils.faults import fault_point

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
_RESERVED_KEYS = ("step", "time")


@dataclass(frozen=True)
class WandbSettings:
    """Where a run goes on Weights & Biases (slime's --wandb-* flags; None: W&B's own default)."""

    project: str | None = None
    entity: str | None = None  # --wandb-team
    group: str | None = None
    name: str | None = None  # --wandb-run-name
    mode: str | None = None  # online | offline (no network: the run stays in <run_dir>/wandb) | disabled
    host: str | None = None  # server URL; the API key comes from W&B's own login / WANDB_API_KEY


def read_metrics(path: str) -> list[dict]:
    """Records of a metrics.jsonl file (or of `<path>/metrics.jsonl` for a run directory), in file order.

    Lines that are not JSON objects with an int "step" (a line torn by a crash mid-write) are skipped with a
    warning.
    """
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            record = _parse_line(line)
            if record is None:
                if line.strip():
                    logger.warning("%s line %d is not a metrics record: skipped", path, lineno)
                continue
            records.append(record)
    return records


class MetricsLogger:
    """Writes metrics to `run_dir/metrics.jsonl`, TensorBoard (`run_dir/tensorboard`) and optionally W&B.

    start_step: the first step this run will log. Lines already in metrics.jsonl with step >= start_step
    are dropped at construction (a resumed run redoes those steps), so curves stay monotone; a fresh run
    (start_step=0) thus starts an empty file. TensorBoard events from those steps are purged the same way.
    With a loop that logs step s and then checkpoints "after step s", resuming that checkpoint means
    start_step = s + 1.
    W&B (`wandb` settings given) is imported only then; its run id is kept in `run_dir/wandb_run_id` so a resumed
    run continues the same W&B run.
    config: the run's configuration, given to W&B as the run config (`wandb.init(config=...)`) and written to
    TensorBoard as text (tag "config", YAML).
    """

    def __init__(
        self,
        run_dir: str,
        use_tensorboard: bool = True,
        wandb: WandbSettings | None = None,
        *,
        start_step: int = 0,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(start_step, int) or isinstance(start_step, bool) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative int, got {start_step!r}")
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.nonfinite_counts: dict[str, int] = {}
        self._last_step = _truncate_from(self.path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = _open_tensorboard(run_dir, start_step) if use_tensorboard else None
        if self._tb is not None and config:
            self._tb.add_text("config", _config_text(config), global_step=start_step)
            self._tb.flush()
        self._wandb = _open_wandb(run_dir, wandb, config) if wandb is not None else None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one record at `step` (not below the last logged step) and mirror it to TB / W&B."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if step < self._last_step:
            raise ValueError(f"step {step} is below the last logged step {self._last_step}: steps must not decrease")
        values = {key: self._number(key, value) for key, value in metrics.items()}

        record = {"step": step, "time": round(time.time(), 3), **values}
        line = json.dumps(record, allow_nan=False) + "\n"
        fault_point("metrics.write", lambda: (self._file.write(line[: len(line) // 2]), self._file.flush()))
        self._file.write(line)
        self._file.flush()  # a crash loses at most the line being written
        self._last_step = step

        finite = {k: v for k, v in values.items() if v is not None}
        if self._tb is not None:
            for key, value in finite.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None and finite:
            self._wandb.log(finite, step=step)

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self.nonfinite_counts:
            logger.warning("non-finite metric values written as null: %s", self.nonfinite_counts)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _number(self, key: str, value: Any) -> int | float | None:
        """A JSON-safe number: int, finite float, or None for NaN/inf (counted)."""
        if not isinstance(key, str) or not key or key in _RESERVED_KEYS:
            raise ValueError(f"metric key must be a non-empty string other than {_RESERVED_KEYS}, got {key!r}")
        if not isinstance(value, (int, float)) and callable(getattr(value, "item", None)):
            # torch tensors and numpy scalars/arrays: accept exactly one element
            size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 1)
            if size != 1:
                raise ValueError(f"metric {key!r} must be a scalar, got {size} elements")
            value = value.item()
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            count = self.nonfinite_counts.get(key, 0) + 1
            self.nonfinite_counts[key] = count
            if count == 1:
                logger.warning("metric %r is %s: written as null (further occurrences only counted)", key, value)
            return None
        raise ValueError(f"metric {key!r} must be a number, got {type(value).__name__}")


def _parse_line(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def _truncate_from(path: str, start_step: int) -> int:
    """Drop records with step >= start_step (and torn lines) from `path`; return the last kept step, or 0."""
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    kept = []
    for line in lines:
        record = _parse_line(line)
        if record is not None and record["step"] < start_step:
            kept.append((record["step"], line if line.endswith("\n") else line + "\n"))
    if len(kept) != len(lines):
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(line for _, line in kept)
        os.replace(tmp, path)  # atomic: a crash here leaves either the old or the truncated file
        logger.info("%s: dropped %d line(s) with step >= %d", path, len(lines) - len(kept), start_step)
    return max((step for step, _ in kept), default=0)


def _open_tensorboard(run_dir: str, start_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError("TensorBoard logging needs the `tensorboard` package (or use_tensorboard=False)") from err
    # purge_step hides events from an earlier attempt at steps >= start_step, like the jsonl truncation.
    return SummaryWriter(log_dir=os.path.join(run_dir, TENSORBOARD_DIR), purge_step=start_step or None)


def _config_text(config: Mapping[str, Any]) -> str:
    """The config as YAML in a Markdown code block (TensorBoard renders text as Markdown)."""
    import yaml

    return "```yaml\n" + yaml.safe_dump(_plain(config), sort_keys=False) + "```"


def _plain(value: Any) -> Any:
    """`value` with tuples as lists (YAML's and W&B's config types)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _open_wandb(run_dir: str, settings: WandbSettings, config: Mapping[str, Any] | None):
    try:
        import wandb
    except ImportError as err:
        raise ImportError("--use-wandb needs the `wandb` package: pip install 'slime_sparse[wandb]'") from err
    id_file = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.exists(id_file):
        with open(id_file, encoding="utf-8") as fh:
            run_id = fh.read().strip()
    else:
        run_id = uuid.uuid4().hex[:8]  # W&B ids are [a-z0-9]; wandb.util.generate_id is gone in wandb 0.31
        with open(id_file, "w", encoding="utf-8") as fh:
            fh.write(run_id + "\n")
    return wandb.init(
        project=settings.project, entity=settings.entity, group=settings.group, name=settings.name,
        mode=settings.mode, id=run_id, resume="allow", dir=run_dir, config=_plain(config) if config else None,
        settings=wandb.Settings(base_url=settings.host) if settings.host else None,
    )


# ----------------------------------------------------------------------------------------------- progress


class Progress:
    """A progress bar: tqdm when stderr is a terminal, otherwise a log line (logger "slime_sparse.progress",
    level INFO) at most every `log_interval_s` seconds and at the end, e.g.

        rollouts: 40/200 (20%) 1.52 it/s, eta 1m45s | reward=0.412

    enabled=False shows nothing. `initial` is where a resumed loop starts: with an iterable and no total,
    total = initial + len(iterable) (so `progress_bar(range(start, n), initial=start)` counts to n).
    """

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        initial: int = 0,
        enabled: bool = True,
        log_interval_s: float = 30.0,
        tty: bool | None = None,
    ) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = initial + len(iterable)
        self.iterable = iterable
        self.total = total
        self.desc = desc
        self.n = initial
        self.enabled = enabled
        self.log_interval_s = log_interval_s
        self.postfix: dict[str, Any] = {}
        self._initial = initial
        self._start = self._last_log = time.monotonic()
        self._closed = False
        use_tqdm = enabled and (sys.stderr.isatty() if tty is None else tty)
        self._bar = None
        if use_tqdm:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, initial=initial, dynamic_ncols=True)

    def __iter__(self) -> Iterator:
        if self.iterable is None:
            raise TypeError("this Progress was created without an iterable: call update() instead")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and (now - self._last_log >= self.log_interval_s or self.n == self.total):
            self._last_log = now
            logging.getLogger("slime_sparse.progress").info(self.format_line(now - self._start))

    def set_postfix(self, **values: Any) -> None:
        """Values shown after the counter (e.g. reward=f"{r:.3f}"); replaces the previous ones."""
        self.postfix = dict(values)
        if self._bar is not None:
            self._bar.set_postfix(values)

    def format_line(self, elapsed_s: float) -> str:
        done = self.n - self._initial
        rate = done / elapsed_s if elapsed_s > 0 else 0.0
        parts = [f"{self.desc}: {self.n}" if self.desc else str(self.n)]
        if self.total:
            parts[0] += f"/{self.total} ({100.0 * self.n / self.total:.0f}%)"
        parts.append(f"{rate:.2f} it/s")
        if self.total and rate > 0:
            parts[-1] += f", eta {_format_seconds((self.total - self.n) / rate)}"
        line = " ".join(parts)
        if self.postfix:
            line += " | " + " ".join(f"{k}={v}" for k, v in self.postfix.items())
        return line

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(iterable: Iterable | None = None, **kwargs: Any) -> Progress:
    """`Progress(iterable, **kwargs)`: see Progress for the arguments."""
    return Progress(iterable, **kwargs)


def _format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rem = divmod(seconds, 3600)
    minutes, secs = divmod(rem, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
