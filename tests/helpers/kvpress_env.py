"""kvpress in its own virtual environment (.cache/kvpress-venv): kvpress 0.5.5 needs transformers < 5.3, ours is
newer, so it can serve as an oracle but never as a dependency. Built once with the package registry's pip (~1 min):
the system's torch is reused (--system-site-packages), transformers 5.2.0 and kvpress's light dependencies are
installed over it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".cache" / "kvpress-venv"
PACKAGES = ["transformers==5.2.0", "cachetools>=5.5.2,<6", "fire>=0.6.0,<0.7"]
KVPRESS = "kvpress==0.5.5"


def kvpress_python() -> Path:
    """The venv's python, built if missing."""
    python = VENV / "bin" / "python"
    probe = [str(python), "-c", "import kvpress, transformers; assert transformers.__version__ == '5.2.0'"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + PACKAGES, check=True)
    subprocess.run(pip + ["--no-deps", KVPRESS], check=True)  # its other requirements are unused by the presses
    subprocess.run(probe, check=True)
    return python
