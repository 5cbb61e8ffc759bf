"""Reward configuration (`--rm-type`, `--custom-rm-path`) and loading of custom graders."""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from dataclasses import dataclass, field

from slime_sparse.reward.registry import Grader, get_registered_reward


def load_custom_reward(path: str) -> Grader:
    """Import the grader named by `--custom-rm-path`.

    Accepts `package.module:function` and, like slime, `package.module.function`. The module may live in the
    working directory (as with `python -m`, also under the `slime-sparse-train` console script, whose
    sys.path lacks it; it is appended, so it never shadows an installed package). The function must be
    synchronous with signature `fn(response: str, label, **kwargs) -> float`. (slime's own custom rewards
    are `async def fn(args, sample)`; they must be wrapped.) Errors are ValueErrors naming the flag.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"--custom-rm-path must be 'module.path:function', got {path!r}")
    path = path.strip()
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"--custom-rm-path {path!r} must name a module and a function, as 'module.path:function' "
            "or 'module.path.function'"
        )
    try:
        module = _import_from_here(module_name)
    except ImportError as exc:
        raise ValueError(f"--custom-rm-path {path!r}: cannot import module {module_name!r} ({exc})") from exc

    obj = module
    for part in attr.split("."):  # allows `module:Class.staticmethod`
        if not hasattr(obj, part):
            raise ValueError(f"--custom-rm-path {path!r}: module {module_name!r} has no function {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--custom-rm-path {path!r}: {attr!r} is a {type(obj).__name__}, not a function")
    if inspect.iscoroutinefunction(obj):
        raise ValueError(
            f"--custom-rm-path {path!r}: {attr!r} is async; rewards here are synchronous "
            "fn(response: str, label, **kwargs) -> float (they already run in worker processes)"
        )
    return obj


def _import_from_here(module_name: str):
    """import_module, retried with the working directory on sys.path when the module is not found."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        here = os.getcwd()
        if exc.name != top or here in sys.path or "" in sys.path or not _in_directory(here, top):
            raise
        sys.path.append(here)  # also what worker processes get (they inherit our sys.path)
        return importlib.import_module(module_name)


def _in_directory(directory: str, top: str) -> bool:
    return os.path.isfile(os.path.join(directory, f"{top}.py")) or os.path.isdir(os.path.join(directory, top))


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored.

    rm_type: registered grader name (`--rm-type`): "math" (boxed answer + MATH normalisation + sympy,
        the grader the Sparse-RL authors trained with), "math_verify" (HF math-verify), or a user task.
    custom_rm_path: `module.path:function` (`--custom-rm-path`); when set it wins over rm_type, as in slime.
    timeout_s: wall-clock limit of one grader call; a call past it scores 0 and counts as a timeout.
    num_workers: grader processes. 0 grades in the calling thread: no timeout is enforced there (a hung
        grader hangs the caller), meant for debugging and for graders that are trivially fast.
    memory_limit_mb: cap of each grader process's data segment (`--rm-memory-limit-mb`; 0: none): an answer
        such as 10^(10^10) makes sympy or math-verify raise MemoryError (scored 0, counted) instead of
        taking the machine's memory. Not enforced with num_workers=0.
    """

    rm_type: str = field(default="math", metadata={"help": (
        "registered grader (slime: no default); math here: the paper's boxed math answers")})
    custom_rm_path: str | None = None
    timeout_s: float = 5.0
    num_workers: int = 2
    memory_limit_mb: int = field(default=2048, metadata={"help": (
        "cap (MiB) of each grader process's data segment, 0: none; an answer that would take the machine's "
        "memory scores 0 and is counted (not enforced with --rm-num-workers 0)")})

    def validate(self) -> None:
        """Raise ValueError naming the offending flag; imports the custom grader to check it exists."""
        if not isinstance(self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s (reward grader timeout) must be a positive number, got {self.timeout_s!r}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"num_workers (reward worker processes) must be an int >= 0, got {self.num_workers!r}")
        if isinstance(self.memory_limit_mb, bool) or not isinstance(self.memory_limit_mb, int) or not (
                self.memory_limit_mb == 0 or self.memory_limit_mb >= 256):
            raise ValueError(f"--rm-memory-limit-mb must be 0 (no cap) or an int >= 256, got {self.memory_limit_mb!r}")
        self.resolve_grader()

    def resolve_grader(self) -> Grader:
        """The grader this config selects (custom path first, then the registry)."""
        if self.custom_rm_path is not None:
            return load_custom_reward(self.custom_rm_path)
        if not isinstance(self.rm_type, str) or not self.rm_type.strip():
            raise ValueError(f"--rm-type must be a non-empty string (or pass --custom-rm-path), got {self.rm_type!r}")
        return get_registered_reward(self.rm_type.strip())
