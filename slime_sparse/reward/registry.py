"""Name -> grader registry behind `--rm-type`.

A grader scores one response against its label:

    def grader(response: str, label: Any, **kwargs) -> float   # 1.0 correct, 0.0 otherwise

`**kwargs` carries optional per-sample extras (prompt, metadata, ...) chosen by the caller; graders must
accept and may ignore them. Graders are plain synchronous functions: they run in worker processes (see
`pool.py`), so they must be defined at module level (importable by `module:qualname`).

Built-ins (`math`, `math_verify`) register themselves on import; user tasks register with the same
decorator, or are named on the command line with `--custom-rm-path`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol


class Grader(Protocol):
    def __call__(self, response: str, label: Any, **kwargs: Any) -> float: ...


_REGISTRY: dict[str, Grader] = {}

# Modules whose import registers the built-in graders (imported lazily to avoid an import cycle:
# they import this module for the decorator).
_BUILTIN_MODULES = ("slime_sparse.reward.math_grader", "slime_sparse.reward.math_verify_grader")


def _qualified_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def register_reward(name: str) -> Callable[[Grader], Grader]:
    """Decorator: register `fn` as the grader selected by `--rm-type name`; returns `fn` unchanged."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_reward: the reward name must be a non-empty string, got {name!r}")
    name = name.strip()

    def decorator(fn: Grader) -> Grader:
        if not callable(fn):
            raise ValueError(f"register_reward({name!r}): {fn!r} is not callable")
        previous = _REGISTRY.get(name)
        # Re-importing a module (e.g. importlib.reload) re-registers "the same" function as a new object:
        # accept that, but refuse to silently replace a different grader under an existing name.
        if previous is not None and _qualified_name(previous) != _qualified_name(fn):
            raise ValueError(
                f"register_reward: the name {name!r} is already taken by {_qualified_name(previous)}; "
                f"cannot register {_qualified_name(fn)} under it"
            )
        _REGISTRY[name] = fn
        return fn

    return decorator


def _ensure_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def registered_rewards() -> list[str]:
    """Names accepted by `--rm-type`, sorted."""
    _ensure_builtins()
    return sorted(_REGISTRY)


def get_registered_reward(name: str) -> Grader:
    """The grader registered under `name`; ValueError naming `--rm-type` when there is none."""
    _ensure_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"--rm-type {name!r} is not a registered reward; choose one of {sorted(_REGISTRY)}, "
            "register one with slime_sparse.reward.register_reward, or pass --custom-rm-path module:function"
        ) from None
