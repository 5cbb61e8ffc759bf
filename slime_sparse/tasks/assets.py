"""Build (or reuse) everything the default embedded run needs: data, tokenizer, tiny model, warm start.

Assets live in `<cache_dir>/<task>-<hash>/` (repeated_add or long_recall), where the hash covers every
generation parameter, so a rerun with the same parameters is a cache hit and any change builds a fresh directory:

    tokenizer/         HF tokenizer directory (char level)
    init_model/        randomly initialised tiny Qwen2 (safetensors + tokenizer), the "no warm start" baseline
    model/             the warm-started model (or a copy of init_model when the warm start is disabled)
    train.jsonl        {"prompt", "label", "response"} per line ("response" = reference scratchpad)
    test.jsonl         disjoint from train
    assets.json        the parameters and the warm-start metrics

A build happens in `.repeated_add-<hash>.partial/` and is renamed into place when complete, so an interrupted
build never looks like a cache hit; it is resumable (the warm start checkpoints itself there: a rerun continues
where it stopped), and concurrent builders of the same assets take turns (a lock file in that directory).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from slime_sparse.tasks import long_recall, repeated_add
from slime_sparse.tasks.long_recall import LongRecallConfig
from slime_sparse.tasks.repeated_add import RepeatedAddConfig, read_jsonl, write_jsonl
from slime_sparse.tasks.tiny_model import TinyModelConfig, build_tiny_model, count_parameters
from slime_sparse.tasks.tokenizer import DEFAULT_CHARSET, build_char_tokenizer, save_tokenizer
from slime_sparse.tasks.warm_start import WarmStartConfig, warm_start

# bump when the layout or the generation code changes meaning (2: the warm start on one thread, in micro-batches
# of similar length)
ASSETS_FORMAT_VERSION = 2
_WARM_CHECKPOINT = "warm_start.ckpt"  # in the .partial directory while the warm start runs


def _repeated_add_demos(train: list[dict], test: list[dict], task: RepeatedAddConfig, fraction: float,
                        seed: int) -> list[dict]:
    return repeated_add.with_direct_answers(train, fraction, seed)


# task config type -> (directory prefix, generator(n, seed, config, exclude_prompts), the warm start's
# demonstrations(train, test, config, shortcut fraction, seed): the problems, part of them answered by a shortcut)
TASKS = {
    RepeatedAddConfig: ("repeated_add", repeated_add.generate_dataset, _repeated_add_demos),
    LongRecallConfig: ("long_recall", long_recall.generate_dataset, long_recall.warm_start_demos),
}


@dataclass(frozen=True)
class AssetsConfig:
    task: RepeatedAddConfig | LongRecallConfig = field(default_factory=RepeatedAddConfig)
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    warm_start: WarmStartConfig | None = field(default_factory=WarmStartConfig)  # None: no warm start
    # warm-start demonstrations that give the bare answer: RL's choice to learn (the task's mixer, TASKS)
    direct_answer_frac: float = 0.55
    n_train: int = 3000  # the default ranges allow 3600 distinct problems
    n_test: int = 256
    seed: int = 0  # data, initial weights; the warm start has its own seed in its config
    charset: str = DEFAULT_CHARSET

    def validate(self) -> None:
        self.task.validate()
        self.model.validate()
        if self.warm_start is not None:
            self.warm_start.validate()
        if self.n_train < 1:
            raise ValueError(f"n_train={self.n_train} must be >= 1")
        if self.n_test < 1:
            raise ValueError(f"n_test={self.n_test} must be >= 1")
        if self.n_train + self.n_test > self.task.num_problems:
            raise ValueError(
                f"n_train={self.n_train} + n_test={self.n_test} exceeds the {self.task.num_problems} distinct"
                " problems the task ranges allow"
            )

    def key(self) -> str:
        """Short stable hash of every parameter that changes the assets (and the format version)."""
        params = asdict(self)
        payload = json.dumps({"version": ASSETS_FORMAT_VERSION, **params}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class AssetPaths:
    root: Path
    tokenizer_dir: Path
    init_model_dir: Path
    model_dir: Path
    train_path: Path
    test_path: Path
    metadata_path: Path
    cache_hit: bool

    @classmethod
    def under(cls, root: Path, cache_hit: bool) -> AssetPaths:
        return cls(
            root=root,
            tokenizer_dir=root / "tokenizer",
            init_model_dir=root / "init_model",
            model_dir=root / "model",
            train_path=root / "train.jsonl",
            test_path=root / "test.jsonl",
            metadata_path=root / "assets.json",
            cache_hit=cache_hit,
        )

    def metadata(self) -> dict:
        return json.loads(self.metadata_path.read_text())


def build_assets(
    cache_dir: str | Path,
    config: AssetsConfig = AssetsConfig(),
    log: Callable[[str], None] | None = print,
    progress: bool = True,
) -> AssetPaths:
    """Return the asset paths for `config`, building them first unless they are already cached.

    The build runs in a `.partial` directory renamed into place when complete: an interrupted build never looks
    like a cache hit, and the next call resumes it (the warm start from its last checkpoint). Concurrent builders
    of the same assets take turns on a lock; the later one finds the finished copy. `progress`: the warm start's
    progress bar.
    """
    config.validate()
    cache_dir = Path(cache_dir).expanduser()
    final = cache_dir / f"{TASKS[type(config.task)][0]}-{config.key()}"
    if (final / "assets.json").is_file():
        if log is not None:
            log(f"assets: cache hit {final}")
        return AssetPaths.under(final, cache_hit=True)
    partial = cache_dir / f".{final.name}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    with open(partial / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another builder of the same assets: wait for it
        if (final / "assets.json").is_file():  # it finished them (and renamed its .partial, or we made a new one)
            if partial.is_dir() and [p.name for p in partial.iterdir()] == [".lock"]:
                (partial / ".lock").unlink(missing_ok=True)
                partial.rmdir()
            return AssetPaths.under(final, cache_hit=True)
        if log is not None:
            log(f"assets: building {final} (the warm start resumes if interrupted)")
        metadata = _build_into(partial, config, log, progress)
        (partial / "assets.json").write_text(json.dumps(metadata, indent=2))
        (partial / _WARM_CHECKPOINT).unlink(missing_ok=True)
        os.rename(partial, final)
    if log is not None:
        log(f"assets: built {final}")
    return AssetPaths.under(final, cache_hit=False)


def _build_into(root: Path, config: AssetsConfig, log: Callable[[str], None] | None, progress: bool) -> dict:
    paths = AssetPaths.under(root, cache_hit=False)
    _, generate_dataset, demonstrations = TASKS[type(config.task)]
    train = generate_dataset(config.n_train, config.seed, config.task)
    test = generate_dataset(config.n_test, config.seed + 1, config.task, (r["prompt"] for r in train))
    write_jsonl(paths.train_path, train)
    write_jsonl(paths.test_path, test)

    tokenizer = build_char_tokenizer(config.charset)
    save_tokenizer(tokenizer, paths.tokenizer_dir)
    model = build_tiny_model(tokenizer, config.model, seed=config.seed)
    _save_model(model, tokenizer, paths.init_model_dir)

    warm_metrics = None
    if config.warm_start is not None:
        demos = demonstrations(train, test, config.task, config.direct_answer_frac, config.seed)
        metrics = warm_start(model, tokenizer, demos, config.warm_start, log=log, checkpoint=root / _WARM_CHECKPOINT,
                             progress=progress)
        warm_metrics = {k: v for k, v in asdict(metrics).items() if k not in ("losses", "resumed_from", "seconds")}
        warm_metrics["loss_curve"] = metrics.losses[:: max(1, len(metrics.losses) // 50)]
    _save_model(model, tokenizer, paths.model_dir)
    return {
        "key": config.key(),
        "config": asdict(config),
        "num_parameters": count_parameters(model),
        "warm_start": warm_metrics,
    }


def _save_model(model: torch.nn.Module, tokenizer, path: Path) -> None:
    """HF directory (config + safetensors) with the tokenizer alongside, loadable by from_pretrained."""
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def load_rows(paths: AssetPaths, split: str) -> list[dict]:
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} must be 'train' or 'test'")
    return read_jsonl(paths.train_path if split == "train" else paths.test_path)
