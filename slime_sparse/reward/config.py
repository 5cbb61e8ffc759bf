"""Reward configuration (`--rm-type`, `--custom-rm-path`) and loading of custom graders."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

from slime_sparse.reward.registry import Grader, get_registered_reward
from slime_sparse.utils.imports import load_function


def load_custom_reward(path: str) -> Grader:
    """Import the grader named by `--custom-rm-path` (`package.module:function` or, like slime,
    `package.module.function`; see utils.imports.load_function). The function must be synchronous with
    signature `fn(response: str, label, **kwargs) -> float`. (slime's own custom rewards are
    `async def fn(args, sample)`; they must be wrapped.) Errors are ValueErrors naming the flag.
    """
    fn = load_function(path, "--custom-rm-path")
    if inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"--custom-rm-path {path.strip()!r}: {fn.__name__!r} is async; rewards here are synchronous "
            "fn(response: str, label, **kwargs) -> float (they already run in worker processes)"
        )
    return fn


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored (each field's help says what it does). `rm_type` "math" is boxed answer + MATH
    normalisation + sympy, the grader the Sparse-RL authors trained with; "math_verify" is HF math-verify.
    memory_limit_mb: an answer such as 10^(10^10) makes sympy or math-verify raise MemoryError (scored 0,
    counted) instead of taking the machine's memory."""

    rm_type: str = field(default="math", metadata={"help": (
        "registered grader (slime: no default); math here: the paper's boxed math answers")})
    custom_rm_path: str | None = field(default=None, metadata={"help": (
        "module.path:function grading (response, label); wins over --rm-type, as in slime")})
    timeout_s: float = field(default=5.0, metadata={"help": (
        "wall-clock limit of one grader call; a call past it scores 0 and counts as a timeout")})
    num_workers: int = field(default=2, metadata={"help": (
        "grader processes; 0 grades in the trainer's main thread (debugging, trivially fast graders), the timeout "
        "then enforced by SIGALRM (a grader stuck inside one C call overruns it)")})
    max_error_rate: float = field(default=0.5, metadata={"help": (
        "stop the run (with the first failure's traceback) when more than this fraction of one batch's rewards "
        "errored or timed out; 1: never")})
    memory_limit_mb: int = field(default=2048, metadata={"help": (
        "cap (MiB) of each grader process's data segment, 0: none; an answer that would take the machine's "
        "memory scores 0 and is counted (not enforced with --rm-num-workers 0)")})

    def validate(self) -> None:
        """Raise ValueError naming the offending flag (values only: the grader is found by `check_inputs`)."""
        if not isinstance(self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"--rm-timeout (reward grader timeout) must be a positive number, got {self.timeout_s!r}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"--rm-num-workers (reward worker processes) must be an int >= 0, got {self.num_workers!r}")
        if not isinstance(self.max_error_rate, (int, float)) or not 0.0 <= self.max_error_rate <= 1.0:
            raise ValueError(f"--rm-max-error-rate must lie in [0, 1], got {self.max_error_rate!r}")
        if isinstance(self.memory_limit_mb, bool) or not isinstance(self.memory_limit_mb, int) or not (
                self.memory_limit_mb == 0 or self.memory_limit_mb >= 256):
            raise ValueError(f"--rm-memory-limit-mb must be 0 (no cap) or an int >= 256, got {self.memory_limit_mb!r}")
        if self.custom_rm_path is None and (not isinstance(self.rm_type, str) or not self.rm_type.strip()):
            raise ValueError(f"--rm-type must be a non-empty string (or pass --custom-rm-path), got {self.rm_type!r}")

    def check_inputs(self) -> None:
        """The grader exists: the custom one imports, or --rm-type is registered (at start-up: building the
        config imports no grader)."""
        self.resolve_grader()

    def resolve_grader(self) -> Grader:
        """The grader this config selects (custom path first, then the registry)."""
        if self.custom_rm_path is not None:
            return load_custom_reward(self.custom_rm_path)
        if not isinstance(self.rm_type, str) or not self.rm_type.strip():
            raise ValueError(f"--rm-type must be a non-empty string (or pass --custom-rm-path), got {self.rm_type!r}")
        return get_registered_reward(self.rm_type.strip())
