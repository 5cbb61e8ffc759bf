"""Functions named on the command line by their import path, as slime names its hooks (`--*-path` flags)."""
from __future__ import annotations

import importlib
from typing import Callable


def load_function(path: str, flag: str) -> Callable:
    """The callable at `path`: `package.module.function` (slime's spelling) or `package.module:function`.

    Errors are ValueErrors that name `flag` and the part of the path that failed."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{flag} must be 'package.module.function', got {path!r}")
    path = path.strip()
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{flag} {path!r} must name a module and a function ('package.module.function' or "
                         "'package.module:function')")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{flag} {path!r}: cannot import module {module_name!r} ({exc})") from exc
    for part in attr.split("."):  # `module:Class.method`
        if not hasattr(obj, part):
            raise ValueError(f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{flag} {path!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj
