#!/usr/bin/env bash
# One-time step before tools/gpu_checks.sh runs on the device machine, which reaches no package registry: download
# the wheels its image lacks into the git-ignored .whl/ of this checkout (the device call carries that folder).
#
#   bash tools/fetch_gpu_wheels.sh        # here, with the registry; ~3 MB
#
# The image (Python 3.12, torch 2.11 + CUDA 13, transformers 5.17, numpy, packaging, psutil, pytest, pytest-timeout,
# Triton) lacks only megatron-core; its wheel needs nothing beyond torch, numpy and packaging. The wheel is for
# CPython 3.12 on x86-64 Linux whatever this machine runs (pip's --python-version / --platform).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "megatron-core==0.16.1"
ls -l .whl
