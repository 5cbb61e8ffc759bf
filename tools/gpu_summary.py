#!/usr/bin/env python
"""The one table of figures that ends tools/gpu_checks.sh: per step its status and time, then what it measured, then
#43's targets with met / missed / not measured (tools/gpu_targets.py).

    python tools/gpu_summary.py OUT [OUT ...]   # OUT: what gpu_checks.sh wrote (steps.tsv, <step>.log, *.jsonl)

Figures come from each step's own output: the exactness tests' JSON lines (gpu_report.jsonl), the Megatron smoke
runs' step lines, the rollout and RL-step benchmarks' table rows, the tiny training runs' start/end tables, the
environment step's import lines. The targets come from the benchmarks' JSON records (targets.jsonl, rl_step.jsonl) of
every OUT given (one device call may not hold them all). Standard library only.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_targets import target_lines  # noqa: E402


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


def _status(rc: str, seconds: str, limit: str) -> str:
    if rc == "skipped":
        return "skipped"
    if rc in ("124", "137"):
        return f"TIMEOUT ({limit} s)"
    return "ok" if rc == "0" else f"FAILED (exit {rc})"


def env_figures(log: str) -> list[str]:
    out = [line for line in log.splitlines() if line.startswith(("python ", "GPU "))]
    imports = re.findall(r"^import (\S+) (yes|no)$", log, flags=re.M)
    if imports:
        out.append("imports: " + ", ".join(f"{name} {found}" for name, found in imports))
    return out


def pytest_figures(log: str, report: list[dict]) -> list[str]:
    out = [line.strip("= ") for line in log.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)][-1:]
    out += [line for line in log.splitlines() if line.startswith(("FAILED ", "ERROR ", "SKIPPED "))]
    for row in report:
        check = row.pop("check")
        out.append(f"{check}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in row.items()))
    return out


def megatron_figures(log: str) -> list[str]:
    keep = ("fusions on", "step ", "exported", "done in", "Error", "error:")
    return [line.strip() for line in log.splitlines() if any(k in line for k in keep)
            and not line.lstrip().startswith(("File ", "warnings.warn"))][-12:]


def bench_figures(log: str) -> list[str]:
    rows = []
    for line in log.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("model", "---") or not line.startswith("|"):
            continue
        if len(cells) == 15:  # throughput rows
            model, batch, prompt, new, engine, kv, tps, x_hf = cells[:8]
            rows.append(f"{model} {batch} x {prompt}+{new} {engine} {kv}: {tps} tok/s (x hf {x_hf}), peak KV "
                        f"{cells[9]} MiB, compress {cells[10]} %, captures {cells[14]}")
        elif len(cells) == 8:  # the same-memory table: what fits
            model, prompt, new, gib, kv, slots, fit, x_dense = cells
            rows.append(f"{model} {prompt}+{new} in {gib} GiB, {kv}: {fit} sequences (x dense {x_dense})")
        elif len(cells) == 16:  # the same-memory table: throughput
            model, prompt, new, gib, kv, work, rows_, seqs, mean, tps, x_dense, compress, captured = cells[:13]
            rows.append(f"{model} {prompt}+{new} in {gib} GiB, {kv} {work}: {tps} tok/s, {rows_} rows, {seqs} "
                        f"sequences of {mean} new (x dense {x_dense}), compress {compress} %, captures {captured}, "
                        f"peak {cells[14]} GiB allocated / {cells[13]} GiB admitted")
    return rows or [line for line in log.splitlines() if "Error" in line][-3:]


def training_figures(log: str) -> list[str]:
    """The tiny recipe's run: its time line and start/end table (metric, start, end, change), or its error."""
    keep = ("Sparse-RL tiny run", "eval accuracy", "rollout reward", "KV token savings", "sequence rejection",
            "mismatch KL k3", "Error", "error:")
    return [" ".join(line.split()) for line in log.splitlines() if any(k in line for k in keep)
            and not line.lstrip().startswith(("File ", "warnings.warn"))][-10:]


def rl_step_figures(log: str) -> list[str]:
    """benchmarks/rl_step_bench.py: per mode the step and its phases, the memory rows, the dense / sparse ratios;
    only the steps that finished when it was cut short."""
    rows, steps = [], []
    for line in log.splitlines():
        if line.startswith("# ") and " step " in line and ": " in line:
            steps.append(line[2:])
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("mode", "---", ""):
            continue
        if len(cells) == 15:  # time rows
            mode, rows_at_once, step, rollout, reward, recompute, train, sync, correction, other, gen, learn, mfu, \
                builds, captures = cells
            rows.append(f"{mode} ({rows_at_once} rows at once): step {step} s = rollout {rollout} + recompute "
                        f"{recompute} + learner {train} + update {sync} + correction {correction} + reward {reward} + "
                        f"other {other}; {gen} gen tok/s, learner {learn} tok/s, MFU {mfu} %; after the first step "
                        f"{builds} runner builds, {captures} captures")
        elif len(cells) == 5:  # memory rows
            mode, phase, measured, planned, ratio = cells
            rows.append(f"{mode} {phase}: peak {measured} MiB, planner {planned} MiB ({ratio})")
        elif len(cells) == 4:  # ratio rows
            rows.append(f"{cells[0]}: dense {cells[1]} s / sparse {cells[2]} s = {cells[3]}x")
    return rows or steps or [line for line in log.splitlines() if "Error" in line][-3:]


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


FIGURES = {"env": env_figures, "megatron_smoke": megatron_figures, "train_tiny": training_figures,
           "train_tiny_megatron": training_figures}
FIGURES_BY_PREFIX = {"rollout": bench_figures, "rl_step": rl_step_figures}  # every step of those benchmarks


def summary(out: Path, *more: Path) -> str:
    lines = []
    for directory in (out, *more):
        lines += _steps(directory) + [""]
    lines += ["#43's targets (tools/gpu_targets.py: measured only at their own size, warm, on an H100 / H200)",
              "-" * 100] + target_lines([out, *more])
    return "\n".join(lines)


def _steps(out: Path) -> list[str]:
    report = [json.loads(line) for line in _read(out / "gpu_report.jsonl").splitlines() if line.strip()]
    lines = [f"summary of {out} (logs: <step>.log)", "", f"{'step':20s} {'status':18s} {'s':>5s}  figures", "-" * 100]
    for entry in _read(out / "steps.tsv").splitlines():
        name, rc, seconds, limit, *note = entry.split("\t")
        log = _read(out / f"{name}.log")
        by_prefix = next((f for prefix, f in FIGURES_BY_PREFIX.items() if name.startswith(prefix)), None)
        if name == "gpu_tests":
            figures = pytest_figures(log, report)
        elif name in FIGURES or by_prefix:
            figures = (FIGURES.get(name) or by_prefix)(log)
        else:
            figures = note or log.splitlines()[-2:]
        if rc not in ("0", "skipped") and not figures:
            figures = log.splitlines()[-3:]
        first, *rest = figures or ["-"]
        lines.append(f"{name:20s} {_status(rc, seconds, limit):18s} {seconds:>5s}  {first}")
        lines += [f"{'':45s}{line}" for line in rest]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUT", nargs="+",
                        help="directories tools/gpu_checks.sh wrote (steps.tsv, logs, JSON records)")
    args = parser.parse_args(argv)
    outs = [Path(o) for o in args.out]
    for out in outs:
        if not (out / "steps.tsv").is_file():
            parser.error(f"{out}: no steps.tsv here (not a directory tools/gpu_checks.sh wrote)")
    print(summary(*outs))


if __name__ == "__main__":
    main()  # returns (no SystemExit): gpu_checks.sh's callers may run it in their own process (runpy)
