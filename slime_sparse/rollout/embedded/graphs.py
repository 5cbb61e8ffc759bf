"""CUDA graphs of the engine's fixed-shape device work: decode steps (step.py) and decode-time compactions
(compressor.py), captured on first use of a key and replayed after, in one memory pool."""
from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch

logger = logging.getLogger(__name__)


class CapturedGraphs:
    """CUDA graphs captured on first use of a key and replayed after (`run`), all in one memory pool (the steps and
    compactions they hold never overlap). The first call of a key runs the function eagerly on a side stream (a real
    step, and the warm-up of its kernels: lazy initialisation, e.g. of cuBLAS workspaces, must not happen during the
    capture, PyTorch's recipe), then captures it without running it. A key whose capture fails runs eagerly from then
    on, with one warning: graphs are a speed-up, never a reason to stop."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._eager: set[Hashable] = set()
        self._pool = None
        self.captures = 0

    def run(self, key: Hashable, fn: Callable[[], object]) -> object:
        if key in self._graphs:
            graph, out = self._graphs[key]
            graph.replay()
            return out
        if key in self._eager:
            return fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA work of other threads (a weight-sync or logging thread) must not void the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                captured = fn()
        except RuntimeError as err:
            logger.warning("CUDA graph capture of %s failed, running it eagerly: %s", key, err)
            self._eager.add(key)
            return out
        self._pool = self._pool or graph.pool()
        self._graphs[key] = (graph, captured)
        self.captures += 1
        return out
