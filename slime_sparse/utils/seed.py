"""Seeding and RNG state capture for reproducible runs and exact resume.

`get_rng_state()` returns only plain Python values and tensors, so a checkpoint holding it can be read back
with `torch.load(..., weights_only=True)` (no arbitrary unpickling).
"""
from __future__ import annotations

import logging
import random
from typing import Any

import torch

try:  # numpy is optional for this module: seed it when present
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with datasets/transformers
    np = None

logger = logging.getLogger(__name__)


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python `random`, numpy's global RNG, torch CPU and every CUDA device.

    deterministic=True also asks torch for deterministic kernels (slower; errors on ops that have none).
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)  # numpy's legacy seeder accepts 32-bit seeds only
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def get_rng_state() -> dict[str, Any]:
    """Snapshot of every RNG we seed: python, numpy (if installed), torch CPU, torch CUDA (if available)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        # Plain ints/lists instead of an ndarray keep the checkpoint loadable with weights_only=True.
        state["numpy"] = {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a snapshot from `get_rng_state()`.

    Entries the current machine cannot use are skipped: numpy state without numpy installed, and CUDA
    states (with a warning) when CUDA is unavailable or the device count changed. The CPU streams are
    always restored.
    """
    if "python" not in state or "torch" not in state:
        raise ValueError(f"RNG state must hold 'python' and 'torch' entries, got keys {sorted(state)}")
    python_state = state["python"]
    # A round trip through torch.save may turn the inner tuple into a list; random.setstate needs tuples.
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    torch.set_rng_state(state["torch"].cpu())
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state(
            (s["kind"], np.asarray(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
        )
    cuda_states = state.get("cuda")
    if cuda_states is None:
        return
    if torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
    else:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        logger.warning(
            "CUDA RNG state for %d device(s) not restored: %d device(s) available", len(cuda_states), available
        )
