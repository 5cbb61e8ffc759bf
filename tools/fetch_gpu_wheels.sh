#!/usr/bin/env bash
# One-time step before tools/gpu_checks.sh runs on the device machine, which reaches no package registry: download
# the wheels its image lacks (tools/gpu_wheels.txt) into the git-ignored .whl/ of this checkout, and build the tiny
# recipe's assets into .cache/tiny_assets (its warm start is minutes of CPU there); the device call carries both.
#
#   bash tools/fetch_gpu_wheels.sh        # here, with the registry; ~4 MB of wheels, ~3 MB of assets
#
# The wheels are for CPython 3.12 on x86-64 Linux whatever this machine runs (pip's --python-version / --platform),
# without their dependencies (--no-deps): tests/gpu/test_wheels.py checks that the list and the image's packages
# (tools/gpu_image_packages.txt) cover every import of the training path.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t wheels < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' tools/gpu_wheels.txt)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
ls -l .whl
PYTHONPATH="$PWD" python3 examples/tiny_cpu/run.py --assets-only
