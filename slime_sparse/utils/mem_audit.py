"""Peak live bytes of the tensors a block of code allocates, on any device (CPU included): what a GPU's allocator
would have to hold for it, the number an engine's memory accounting must predict.

`LiveBytes` is a `TorchDispatchMode`: every tensor an operation returns is followed by its storage (views share
one), counted once while it lives and subtracted when torch frees it (a weakref on the storage). `peak` is the
largest sum of live storages seen during the block, `live` what is still held at its end. Allocations a kernel
makes internally and frees before returning are not seen (on CUDA, `torch.cuda.max_memory_allocated` sees those
too); storages made outside the block are not counted, even when an op inside returns them (`.float()` of an fp32
tensor, a view). `phases` splits the peak by a label the
caller sets (`with tracker.phase("decode"): ...`): each label's peak of bytes allocated above what was live when the
label began.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.phases: dict[str, int] = {}  # label -> peak bytes above the live bytes at the label's start
        self._sizes: dict[int, int] = {}  # storage id -> bytes counted
        self._outside: set[int] = set()  # storages first seen as an input: allocated before the block
        self._active: list[tuple[str, int]] = []  # open phases: (label, live bytes at its start)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):  # made before the block (or outside torch's ops): never counted
                self._known(t.untyped_storage())
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._follow(t.untyped_storage())
        return out

    def _known(self, storage: torch.UntypedStorage) -> None:
        if storage._cdata not in self._sizes and storage._cdata not in self._outside:
            self._outside.add(storage._cdata)
            weakref.finalize(storage, self._outside.discard, storage._cdata)

    @contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """Record, under `label`, the peak of what the block allocates above what is live when it starts (the
        largest over every block of that label)."""
        self._active.append((label, self.live))
        self.phases.setdefault(label, 0)
        try:
            yield
        finally:
            self._active.pop()

    def _follow(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()
        if key in self._outside:  # an op returned (a view of) a tensor made before the block
            return
        known = self._sizes.get(key)
        if known == size:
            return
        if known is None:
            weakref.finalize(storage, self._free, key)
        self._sizes[key] = size
        self.live += size - (known or 0)
        self.peak = max(self.peak, self.live)
        for label, base in self._active:
            self.phases[label] = max(self.phases[label], self.live - base)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
