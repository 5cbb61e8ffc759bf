"""Run megatron-core on CPU (gloo): the CUDA assumptions it makes, patched in one place.

megatron-core 0.16 builds and runs a GPTModel on the local layer spec with gloo, except for spots that
call CUDA unconditionally:

1. the tensor-parallel RNG tracker (`CudaRNGStatesTracker.add/fork` read and write CUDA generator states);
   it is entered on every attention forward (dropout region), even with dropout 0;
2. `GlobalMemoryBuffer.get_tensor` allocates on `torch.cuda.current_device()` (used by the tensor-parallel
   all-gathers and by the local attention's score buffer);
3. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` on the first forward;
4. the forward/backward schedules allocate their token counter with `device="cuda"`, and the pipeline's
   point-to-point layer allocates shape and activation buffers on `torch.cuda.current_device()` and calls
   `torch.cuda.synchronize()`;
5. with pipeline parallelism and tied embeddings, `LanguageModule.setup_embeddings_and_output_layer` moves
   the last stage's copy of the embedding to CUDA (`.cuda()`) before all-reducing it with the first stage;
6. activation recompute (`--recompute-granularity`) saves and restores the CUDA generator's state around each
   recomputed chunk (`tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state`).

Saving a distributed checkpoint (dist_checkpointing, torch_dist format) adds two more: the writer's
`preload_tensors` calls `torch.cuda.synchronize()` and `save_state_dict_async_finalize` broadcasts a
flag allocated on `torch.cuda.current_device()`. (A forward-time one, the default causal mask built with
device="cuda" when no mask is passed, is avoided by always passing the mask: see logprobs.causal_mask.)

`apply_cpu_shim()` replaces (1) with a tracker that keeps *CPU* generator states under the same names, (6) with
the CPU generator's state (the one that generator-using ops on CPU draw from),
and runs the other functions "CUDA on CPU" for the duration of those calls only: `torch.cuda.current_device()`
answers "cpu", `torch.cuda.synchronize()` does nothing, factory functions asked for `device="cuda"` allocate
on the CPU and `Tensor.cuda()` returns the tensor itself. It is a no-op when CUDA is available, idempotent,
and touches nothing else. Megatron's DDP buffers and distributed optimizer remain CUDA-only: on CPU the
learner steps the model with a torch optimizer (see learner.py), but it runs Megatron's own schedules.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def _is_cuda(device) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device).type == "cuda"


class _CudaOnCpuMode(TorchFunctionMode):
    """`device="cuda"` -> CPU for every torch function, and `Tensor.cuda()` -> the tensor itself."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    """Inside the block CUDA requests land on the CPU (see the module docstring); only used when CUDA is
    absent, where all of them would raise."""
    device, sync = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        with _CudaOnCpuMode():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = device, sync  # type: ignore[assignment]


def _on_cpu(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with _current_device_is_cpu():
            return method(*args, **kwargs)

    wrapper.__slime_cpu_shim__ = True  # type: ignore[attr-defined]
    return wrapper


def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """The tensor-parallel RNG tracker over the CPU generator.

        Same bookkeeping as Megatron's (named states, one seed per name, fork restores the caller's
        state), so `model_parallel_cuda_manual_seed` works unchanged on top of it.
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"RNG seed {seed} is already tracked")
            if name in self.states_:
                raise ValueError(f"RNG state {name!r} is already tracked")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise ValueError(f"RNG state {name!r} was never added (call model_parallel_cuda_manual_seed)")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    return CpuRNGStatesTracker


def apply_cpu_shim() -> bool:
    """Patch megatron-core for CPU execution when CUDA is absent. Returns True if the shim is active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    from megatron.core import utils as mutils
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    tracker_cls = _make_cpu_tracker_class()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker_cls()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True  # initialize_rng_tracker() keeps ours
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    mutils.GlobalMemoryBuffer.get_tensor = _on_cpu(mutils.GlobalMemoryBuffer.get_tensor)
    rope.RotaryEmbedding.get_emb = _on_cpu(rope.RotaryEmbedding.get_emb)
    LanguageModule.setup_embeddings_and_output_layer = _on_cpu(LanguageModule.setup_embeddings_and_output_layer)
    # get_forward_backward_func looks these up in the module at call time, so it returns the wrapped ones
    for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving"):
        setattr(schedules, name, _on_cpu(getattr(schedules, name)))

    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    writer = filesystem_async.FileSystemWriterAsync
    writer.preload_tensors = staticmethod(_on_cpu(writer.preload_tensors))
    finalize = _on_cpu(state_dict_saver.save_state_dict_async_finalize)
    state_dict_saver.save_state_dict_async_finalize = finalize
    torch_strategy.save_state_dict_async_finalize = finalize  # imported there by name
    _APPLIED = True
    return True


def shim_active() -> bool:
    return _APPLIED
