"""Output paths checked before anything is written: a command that cannot write its results says so at start-up,
in one line naming the flag, rather than after the work (or with a traceback)."""
from __future__ import annotations

import os


def check_writable_dir(path: str, flag: str) -> None:
    """`path` is a directory this process can write into, or one it can create: its nearest existing ancestor is
    a writable directory. ValueError naming `flag` otherwise."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = ("is not writable" if existing == os.path.abspath(path)
                else f"cannot be created ({existing} is not writable)")
        raise ValueError(f"{flag} {path}: {what}")


def check_writable_file(path: str, flag: str) -> None:
    """`path` names a file this process can write (its directory can be written or created)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory, not a file path")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: is not writable")
    check_writable_dir(os.path.dirname(os.path.abspath(path)), flag)
