"""`benchmarks/decode_step_bench.py --count` end to end at CI size (meta device: nothing is timed): the columns it
reports besides time say what #43 item 3 claims, at a tiny and a Qwen2.5-1.5B shape."""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_step_bench.py"


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.skipif(shutil.which("git") is None, reason="--before extracts a commit with git")
def test_count_table_halves_the_ops_and_cuts_the_bytes():
    spec = importlib.util.spec_from_file_location("bench_decode_step", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    lines = bench.main(["--count", "--before", "HEAD", "--shapes", "tiny", "qwen2.5-1.5b", "--batch", "8",
                        "--context", "64", "--mean-length", "40"])
    header = cells(lines[0])
    rows = [dict(zip(header, cells(line))) for line in lines[2:]]
    for shape in ("tiny", "qwen2.5-1.5b"):
        by = {r["engine"]: r for r in rows if r["shape"] == shape}
        hf, fused = int(by["after: hf modules + sdpa"]["ops / step"]), by["after: body + triton + sampler kernel"]
        assert int(fused["ops / step"]) <= hf / 2  # the step as a GPU runs it: half the launches or fewer
        assert int(by["after: body + sdpa"]["ops / step"]) < hf  # on CPU too (torch sampler)
        assert float(fused["GB read + written / step"]) < float(by["after: hf modules + sdpa"]["GB read + written / step"])
        assert by["before"]["ops / step"] == by["after: hf modules + sdpa"]["ops / step"]  # HEAD's HF-module step
