"""#43's targets, each read from the records the GPU check's benchmarks write, with met / missed / not measured.

    records: OUT/targets.jsonl (benchmarks/rollout_bench.py --json, and the hooks' steps) and OUT/rl_step.jsonl
    (benchmarks/rl_step_bench.py --out), from one or more OUT directories (the RL step's two modes may come from two
    device calls: tools/gpu_checks.sh OUT rl_step_dense, then OUT2 rl_step_sparse; pass both to gpu_summary.py)

A target is measured only by a record at its own size (model shape, batch, lengths, memory), on an H100 or H200, whose
timed calls captured no CUDA graph (a call that captures is not warm); anything else is "not measured", and the nearest
record of the same kind is shown beside it for information. Standard library only.

Record shapes a hook may add to targets.jsonl: {"table": "compaction_scratch", "model": "qwen2.5-1.5b", "batch": 256,
"scratch_gib": float} (the compaction's working set at batch 256, R-KV 512 + 128, bf16).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MODEL = "qwen2.5-1.5b"
GPUS = ("H100", "H200")
RKV = "rkv B=512"  # the per-batch table's name of R-KV 512 + 128
RKV_FULL = "rkv B=512+128"  # the same-memory tables'


@dataclass(frozen=True)
class Target:
    name: str
    text: str
    check: Callable[[list[dict], list[dict]], tuple[str, str]]  # (targets records, RL-step records) -> (status, figure)


def read_records(outs: list[Path]) -> tuple[list[dict], list[dict]]:
    def read(path: Path) -> list[dict]:
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
                if line.strip().startswith("{")]
    return [r for out in outs for r in read(out / "targets.jsonl")], [r for out in outs for r in read(out / "rl_step.jsonl")]


def _num(value) -> float | None:
    try:
        return float(str(value).split()[0])
    except (TypeError, ValueError, IndexError):
        return None


def _on_gpu(record: dict) -> bool:
    return any(gpu in str(record.get("machine", record.get("device", ""))) for gpu in GPUS)


def _judge(value: float, bound: float, at_least: bool, figure: str, records: list[dict]) -> tuple[str, str]:
    """met / missed for a measured value, unless a record was made off the target GPUs or with captures."""
    where = {str(r.get("machine", r.get("device", "?"))) for r in records}
    if not all(_on_gpu(r) for r in records):
        return "not measured", f"{figure} (on {', '.join(sorted(where))}: not an H100 / H200)"
    cold = [r for r in records if str(r.get("captures", "0")) not in ("0", "-")]
    if cold:
        return "not measured", f"{figure} (a timed call captured {cold[0]['captures']} graphs: not warm)"
    met = value >= bound if at_least else value <= bound
    return ("met" if met else "missed"), f"{figure} on {', '.join(sorted(where))}"


def _batch(records: list[dict], batch: int, new: int, kv: str) -> dict | None:
    return next((r for r in records if r.get("table") == "batch" and r.get("model") == MODEL
                 and r.get("batch") == str(batch) and r.get("new") == str(new) and r.get("engine") == "after"
                 and r.get("KV") == kv), None)


def _nearest(records: list[dict], table: str, describe: Callable[[dict], str],
             keep: Callable[[dict], bool] = lambda r: True) -> str:
    others = [r for r in records if r.get("table") == table and keep(r)]
    return f"not at the target's size; measured: {'; '.join(describe(r) for r in others[-3:])}" if others else \
        "no record"


def _describe_batch(r: dict) -> str:
    return f"{r.get('model')} {r.get('batch')} x +{r.get('new')} {r.get('KV')}: {r.get('tok/s')} tok/s"


def dense_tok_s(batch: int, new: int, bound: float):
    def check(records: list[dict], _rl: list[dict]) -> tuple[str, str]:
        r = _batch(records, batch, new, "dense")
        if r is None:
            return "not measured", _nearest(records, "batch", _describe_batch,
                                            lambda x: x.get("KV") == "dense" and x.get("engine") == "after")
        tps = _num(r["tok/s"])
        return _judge(tps, bound, True, f"{tps:,.0f} tok/s", [r])
    return check


def compaction_share(records: list[dict], _rl: list[dict]) -> tuple[str, str]:
    r = _batch(records, 256, 4096, RKV)
    if r is None or _num(r.get("compress %")) is None:
        return "not measured", _nearest(records, "batch", lambda x: f"{_describe_batch(x)}, compress "
                                        f"{x.get('compress %')} %",
                                        lambda x: x.get("KV", "").startswith("rkv") and x.get("engine") == "after")
    share = _num(r["compress %"])
    return _judge(share, 2.0, False, f"{share:.1f} % of the call", [r])


def compaction_scratch(records: list[dict], _rl: list[dict]) -> tuple[str, str]:
    r = next((x for x in records if x.get("table") == "compaction_scratch" and x.get("model") == MODEL
              and int(x.get("batch", 0)) == 256), None)
    if r is None:
        return "not measured", "no compaction_scratch record (the compaction's GPU check, a hook of gpu_checks.sh)"
    return _judge(float(r["scratch_gib"]), 1.0, False, f"{float(r['scratch_gib']):.2f} GiB", [r])


def same_memory(workload: str, bound: float):
    def check(records: list[dict], _rl: list[dict]) -> tuple[str, str]:
        at = [r for r in records if r.get("table") == "same_memory" and r.get("model") == MODEL
              and r.get("new") == 4096 and r.get("memory_gib") == 24 and r.get("workload") == workload]
        dense = next((r for r in at if r["kv"] == "dense"), None)
        rkv = next((r for r in at if r["kv"] == RKV_FULL), None)
        if dense is None or rkv is None:
            return "not measured", _nearest(records, "same_memory", lambda r: (
                f"{r['model']} +{r['new']} in {r['memory_gib']} GiB, {r['kv']}: x dense {r['x_dense']:.2f}"),
                lambda r: r.get("workload") == workload and r.get("kv") != "dense")
        ratio = rkv["tok_s"] / dense["tok_s"]
        figure = (f"{ratio:.2f}x ({rkv['tok_s']:,.0f} / {dense['tok_s']:,.0f} tok/s, {rkv['rows']} / {dense['rows']} "
                  f"rows)")
        return _judge(ratio, bound, True, figure, [dense, rkv])
    return check


def same_batch(records: list[dict], _rl: list[dict]) -> tuple[str, str]:
    dense, rkv = _batch(records, 256, 4096, "dense"), _batch(records, 256, 4096, RKV)
    if dense is None or rkv is None:
        return "not measured", _nearest(records, "batch", _describe_batch, lambda x: x.get("engine") == "after")
    ratio = _num(rkv["tok/s"]) / _num(dense["tok/s"])
    return _judge(ratio, 1.3, True, f"{ratio:.2f}x ({rkv['tok/s']} / {dense['tok/s']} tok/s)", [dense, rkv])


def rl_step(key: str, bound: float):
    """The median over the timed steps (all but each mode's first) of dense's seconds over sparse's."""
    def check(_records: list[dict], rl: list[dict]) -> tuple[str, str]:
        full = [r for r in rl if r.get("shape") == "1.5b" and r.get("prompts") == 64 and r.get("n_samples") == 8
                and r.get("response_len") == 4096]
        modes = {m: [r for r in full if r["mode"] == m and r["step"] > 0] for m in ("dense", "sparse")}
        gib = {r.get("kv_gib") for r in full}
        if not all(modes.values()) or len(gib) != 1:
            near = [r for r in rl if r.get("step", 0) > 0]
            return "not measured", ("not at the target's size (1.5b, 64 x 8, +4096, one memory for both modes); "
                                    f"measured: {_rl_ratio(near, key)}" if near else "no record")
        seconds = {m: statistics.median(r["seconds"][key] for r in rs) for m, rs in modes.items()}
        ratio = seconds["dense"] / seconds["sparse"]
        return _judge(ratio, bound, True, f"{ratio:.2f}x ({seconds['dense']:.1f} / {seconds['sparse']:.1f} s)",
                      modes["dense"] + modes["sparse"])
    return check


def _rl_ratio(records: list[dict], key: str) -> str:
    by = {}
    for r in records:
        size = f"{r.get('shape')} {r.get('prompts')} x {r.get('n_samples')} x +{r.get('response_len')}"
        by.setdefault(size, {}).setdefault(r["mode"], []).append(r["seconds"][key])
    return "; ".join(f"{size}: {statistics.median(m['dense']) / statistics.median(m['sparse']):.2f}x"
                     for size, m in by.items() if {"dense", "sparse"} <= set(m)) or "one mode only"


TARGETS = (
    Target("dense_64", "Dense: batch 64 +128 >= 16,000 tok/s", dense_tok_s(64, 128, 16_000)),
    Target("dense_256", "Dense: batch 256 +4,096 >= 30,000 tok/s", dense_tok_s(256, 4096, 30_000)),
    Target("compaction_share", "Compaction <= 2 % of the R-KV call (batch 256 +4,096)", compaction_share),
    Target("compaction_scratch", "Compaction scratch <= 1 GiB at batch 256", compaction_scratch),
    Target("same_memory_fixed", "24 GiB, +4,096: R-KV 512+128 >= 2.5x dense, fixed-length wave",
           same_memory("fixed", 2.5)),
    Target("same_memory_mix", "24 GiB, +4,096: R-KV 512+128 >= 2x dense, length mix", same_memory("mix", 2.0)),
    Target("same_batch", "Batch 256 +4,096: R-KV 512+128 >= 1.3x dense", same_batch),
    Target("rl_step", "RL step (1.5B, 64 x 8, +4,096, same memory): R-KV >= 1.4x dense", rl_step("step", 1.4)),
    Target("rl_rollout", "RL step's rollout phase: R-KV >= 2x dense", rl_step("rollout", 2.0)),
)


def target_lines(outs: list[Path]) -> list[str]:
    records, rl = read_records(outs)
    lines = []
    for target in TARGETS:
        status, figure = target.check(records, rl)
        lines.append(f"{target.text:66s} {status:13s} {figure}")
    return lines
