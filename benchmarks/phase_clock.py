"""Timing the phases of the training loop's step around the component calls that do them (rl_step_bench.py): seconds
and peak device memory per phase, each call between two device syncs, the loop itself untouched. Device memory is
torch's allocated memory plus the KV cache an offloading engine maps at fixed addresses (utils/cuda_vmm.py), which
torch's statistics do not see."""
from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from slime_sparse.rollout import pipeline
from slime_sparse.utils import cuda_vmm

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CORRECTION_FNS = ("judge_rows", "batch_correction", "group_baseline_advantages", "kv_metrics", "mismatch_metrics",
                  "mismatch_split_metrics", "shadow_metrics")  # what the pipeline calls for the correction, advantages and their metrics


class PhaseClock:
    """Seconds and peak device memory per phase, accumulated over the calls of one step."""

    def __init__(self, device: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.clock = clock
        self.seconds: Counter = Counter()
        self.peak: dict[str, int] = {}
        self._inside: str | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self._inside is not None:  # a phase inside another would be counted twice
                raise RuntimeError(f"phase {phase!r} called inside phase {self._inside!r}")
            self._inside = phase
            self.sync()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
                cuda_vmm.reset_peak_mapped_bytes()
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[phase] += self.clock() - t0
                if self.cuda:
                    peak = torch.cuda.max_memory_allocated() + cuda_vmm.max_mapped_bytes()
                    self.peak[phase] = max(self.peak.get(phase, 0), peak)
                self._inside = None
        return timed

    def reset(self) -> None:
        self.seconds, self.peak = Counter(), {}


class _Proxy:
    """`target` with some methods replaced (the timed ones); every other attribute is the target's."""

    def __init__(self, target: Any, **methods: Callable) -> None:
        self._target = target
        self.__dict__.update(methods)

    def __getattr__(self, name: str):
        return getattr(self._target, name)


@contextmanager
def timed_components(components, clock: PhaseClock) -> Iterator[None]:
    """The components' phase calls and the pipeline's correction functions timed by `clock`; restored after."""
    saved = {name: getattr(components, name) for name in ("engine", "learner", "reward_fn", "tokenizer")}
    fns = {name: getattr(pipeline, name) for name in CORRECTION_FNS}
    engine, learner, tokenizer = saved["engine"], saved["learner"], saved["tokenizer"]
    components.engine = _Proxy(engine, generate=clock.wrap("rollout", engine.generate),
                               sync_from=clock.wrap("weight update", engine.sync_from))
    components.learner = _Proxy(learner, compute_logprobs=clock.wrap("recompute", learner.compute_logprobs),
                                train_step=clock.wrap("learner step", learner.train_step))
    components.reward_fn = clock.wrap("reward", saved["reward_fn"])
    components.tokenizer = _Proxy(tokenizer, batch_decode=clock.wrap("reward", tokenizer.batch_decode))
    for name, fn in fns.items():
        setattr(pipeline, name, clock.wrap("correction", fn))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(components, name, value)
        for name, fn in fns.items():
            setattr(pipeline, name, fn)
