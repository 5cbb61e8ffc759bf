"""Functions named on the command line by their import path, as slime names its hooks (`--custom-rm-path`,
`--dynamic-sampling-filter-path`, ...)."""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Callable


def load_function(path: str, flag: str) -> Callable:
    """The callable at `path`: `package.module.function` (slime's spelling) or `package.module:function`
    (`module:Class.method` too). The module may live in the working directory (as with `python -m`, also under
    the console scripts, whose sys.path lacks it). Errors are ValueErrors that name `flag` and what failed."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{flag} must be 'module.path:function', got {path!r}")
    path = path.strip()
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{flag} {path!r} must name a module and a function, as 'module.path:function' "
                         "or 'module.path.function'")
    try:
        obj = import_from_here(module_name)
    except ImportError as exc:
        raise ValueError(f"{flag} {path!r}: cannot import module {module_name!r} ({exc})") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{flag} {path!r}: module {module_name!r} has no function {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{flag} {path!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def import_from_here(module_name: str) -> ModuleType:
    """import_module, retried with the working directory on sys.path when the module is not found there. It is
    appended, so it never shadows an installed package; worker processes inherit it."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        here = os.getcwd()
        if exc.name != top or here in sys.path or "" in sys.path or not _in_directory(here, top):
            raise
        sys.path.append(here)
        return importlib.import_module(module_name)


def _in_directory(directory: str, top: str) -> bool:
    return os.path.isfile(os.path.join(directory, f"{top}.py")) or os.path.isdir(os.path.join(directory, top))
