#!/usr/bin/env python
"""Plot a run's main curves from RUN_DIR/metrics.jsonl into PNG files.

    python tools/plot_metrics.py RUN_DIR [--keys KEY ...] [--out-dir DIR] [--smooth 0.6]

Default keys: evaluation accuracy (`eval/pass@1`: every mode and set in one panel), reward, KV savings, sequence
rejection rate, mismatch k3 KL and its sparsity / numeric split (points: logged every 10th rollout), effective batch
size, generated tokens per trained token (dynamic sampling). Keys the run did not log are skipped with a note; when
none is found the available keys are listed and the exit status is 1.
"""
from __future__ import annotations

import argparse
import os
import sys

try:
    from slime_sparse.utils.plots import DEFAULT_PLOT_KEYS, available_keys, plot_metrics
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from slime_sparse.utils.plots import DEFAULT_PLOT_KEYS, available_keys, plot_metrics

from slime_sparse.utils.logging import METRICS_FILE, read_metrics
from slime_sparse.utils.paths import check_writable_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help=f"run directory holding {METRICS_FILE}")
    parser.add_argument("--keys", nargs="+", default=list(DEFAULT_PLOT_KEYS), help="metric keys to plot")
    parser.add_argument("--out-dir", default=None, help="where the PNGs go (default: RUN_DIR/plots)")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1) overlaid on raw curves")
    args = parser.parse_args(argv)

    if not os.path.isfile(os.path.join(args.run_dir, METRICS_FILE)):
        print(f"error: no {METRICS_FILE} in {args.run_dir!r}", file=sys.stderr)
        return 2
    try:
        check_writable_dir(args.out_dir or os.path.join(args.run_dir, "plots"), "--out-dir")  # before plotting
        result = plot_metrics(args.run_dir, keys=args.keys, out_dir=args.out_dir, smooth=args.smooth)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for key in result.missing_keys:
        print(f"note: {key!r} not found in the log, skipped")
    for path in result.files:
        print(f"wrote {path}")
    if not result.files:
        keys = available_keys(read_metrics(args.run_dir))
        print(f"error: none of the keys was found; the log has: {', '.join(keys) or '(no metrics)'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
