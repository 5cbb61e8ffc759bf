"""Contract between our hooks and the pinned SGLang source (downloaded from the package registry, never committed).

The wheel of sglang_patches.version.SGLANG_VERSION is fetched once with `pip download --no-deps` into .cache/ and
parsed with `ast`; nothing of SGLang is imported, so this runs in the default (fast) set.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sglang_patches import contract
from sglang_patches.contract import CHECKS, SourceCheck, check_contract, hooked_symbols_located, run_check
from sglang_patches.hooks import HOOKS
from sglang_patches.source import fetch_sglang_source
from sglang_patches.version import SGLANG_VERSION


@pytest.fixture(scope="module")
def package_dir() -> Path:
    return fetch_sglang_source() / "sglang"


def test_pinned_wheel_is_the_pinned_version(package_dir):
    metadata = (package_dir.parent / f"sglang-{SGLANG_VERSION}.dist-info" / "METADATA").read_text()
    assert f"\nVersion: {SGLANG_VERSION}\n" in metadata
    assert f"'{SGLANG_VERSION}'" in (package_dir / "_version.py").read_text()  # what sglang.__version__ reports


def test_every_hooked_symbol_and_relied_on_line_exists(package_dir):
    assert check_contract(package_dir) == []


def test_each_hook_target_is_located_and_named_by_a_check(package_dir):
    assert hooked_symbols_located(package_dir) == []
    checked = {c.dotted for c in CHECKS}
    for spec in HOOKS:
        owner, method = spec.target.rsplit(".", 1)
        # either the method itself has a check, or its class check lists it among the names it must define
        assert spec.target in checked or any(c.dotted == owner and method in c.names for c in CHECKS), spec.target


def test_contract_detects_a_changed_line(package_dir, tmp_path):
    """The checks can fail: alter the line alloc_for_decode writes the new slot with and re-run its check."""
    rel = "srt/mem_cache/common.py"
    (tmp_path / rel).parent.mkdir(parents=True)
    text = (package_dir / rel).read_text()
    assert "locs = seq_lens_gpu.clone()" in text
    (tmp_path / rel).write_text(text.replace("locs = seq_lens_gpu.clone()", "locs = seq_lens_gpu + 1"))
    check = next(c for c in CHECKS if c.symbol == "alloc_for_decode")
    assert run_check(check, package_dir) == []
    problems = run_check(check, tmp_path)
    assert len(problems) == 1 and "locs = seq_lens_gpu.clone()" in problems[0]


def test_contract_detects_missing_symbols_and_names(package_dir, tmp_path, monkeypatch):
    shutil.copytree(package_dir / "srt" / "plugins", tmp_path / "srt" / "plugins")
    assert run_check(SourceCheck("srt/plugins/hook_registry.py", "HookRegistry.nope", "x"), tmp_path)
    assert run_check(SourceCheck("srt/plugins/hook_registry.py", "HookRegistry", "x", names=("nope",)), tmp_path)
    assert run_check(SourceCheck("srt/not_there.py", "", "x"), tmp_path)
    monkeypatch.setattr(contract, "HOOKED_SYMBOLS", {"sglang.srt.plugins.hook_registry.HookRegistry.nope"})
    assert hooked_symbols_located(tmp_path) == [
        "hook target sglang.srt.plugins.hook_registry.HookRegistry.nope: not defined in srt/plugins/hook_registry.py"
    ]


def test_cli_reports_ok_on_the_pinned_source(package_dir, capsys):
    assert contract.main(["--source", str(package_dir.parent)]) == 0
    assert "OK" in capsys.readouterr().out


def test_contract_detects_a_changed_admission_reservation(package_dir, tmp_path):
    """The admission hooks take min(SGLang's running reservation, our bound): a rewritten formula must be flagged."""
    rel = "srt/managers/schedule_policy.py"
    (tmp_path / rel).parent.mkdir(parents=True)
    text = (package_dir / rel).read_text()
    old = "(req.sampling_params.max_new_tokens - len(req.output_ids))"
    assert text.count(old) == 1
    (tmp_path / rel).write_text(text.replace(old, "(req.sampling_params.max_new_tokens)"))
    check = next(c for c in CHECKS if c.symbol == "PrefillAdder._get_running_request_total_token_offset")
    assert run_check(check, package_dir) == []
    problems = run_check(check, tmp_path)
    assert len(problems) == 1 and old in problems[0]


def test_private_hooks_are_listed_with_the_versions_they_were_read_in(monkeypatch):
    private = {spec.target for spec in HOOKS if contract.is_private(spec.target)}
    assert private == set(contract.PRIVATE_HOOKS) and len(private) == 1  # the rest are public methods
    assert all(SGLANG_VERSION in versions for versions in contract.PRIVATE_HOOKS.values())
    assert contract.private_hooks_listed() == []
    assert not contract.is_private("sglang.srt.server_args.ServerArgs.__post_init__")  # dunders are public
    monkeypatch.setattr(contract, "PRIVATE_HOOKS", {})
    assert contract.private_hooks_listed() == [f"hook target {t}: private, not listed in PRIVATE_HOOKS" for t in private]
    monkeypatch.setattr(contract, "PRIVATE_HOOKS", {t: ("0.5.23",) for t in private})
    assert "not read in the pinned" in contract.private_hooks_listed()[0]
