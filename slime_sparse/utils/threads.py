"""How many CPU threads torch computes with: one rule for training, evaluation and the recipes (`--threads`).

torch's default is one thread per core. A thread pays for itself only when an op is big enough to split: a model of
a few million parameters spends its time in per-op overhead, which more threads add to, and on a machine other jobs
share, threads that wait for a core stall every op (an evaluation of the tiny recipe's model took 17x longer on two
busy cores than on one thread). So the default is one thread per PARAMS_PER_THREAD parameters of the model, at least
one and at most the cores this process may use. The resolved number is written into the run's config.yaml, so a
saved config reruns at the same speed, and on one thread a run's floats do not depend on the machine's core count.
"""
from __future__ import annotations

import glob
import json
import os
import struct
from contextlib import contextmanager
from typing import Iterator

PARAMS_PER_THREAD = 50_000_000  # a 0.5B model gets 10 threads, SmolLM2-135M 2, the tiny recipe's 0.6M one


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def default_threads(num_parameters: int | None, cores: int | None = None) -> int:
    """The rule: one thread per PARAMS_PER_THREAD parameters, within [1, cores]; every core when the size is
    unknown (torch's own default)."""
    cores = available_cores() if cores is None else cores
    if num_parameters is None:
        return max(1, cores)
    return max(1, min(cores, num_parameters // PARAMS_PER_THREAD))


def model_parameters(model_dir: str) -> int | None:
    """Parameters of the HF model in `model_dir`, read from its safetensors headers (no weights loaded); for
    .bin weights their size over 4 bytes; None when it holds neither."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        total = 0
        for path in files:
            with open(path, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    count = 1
                    for dim in info["shape"]:
                        count *= dim
                    total += count
        return total
    bins = glob.glob(os.path.join(model_dir, "*.bin"))
    return sum(os.path.getsize(p) for p in bins) // 4 if bins else None


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block (None: unchanged), restored after, so that a caller in
    the same process (the tests) keeps its own."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
