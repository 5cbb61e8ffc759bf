"""The CPU shim's "CUDA on CPU" redirection: active inside the wrapped calls only, and nothing else changes."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(torch.cuda.is_available(), reason="the shim applies only without CUDA")]


def test_cuda_requests_land_on_the_cpu_inside_wrapped_calls_only():
    from slime_sparse.backends.megatron.cpu_shim import _on_cpu

    def megatron_like():  # the patterns megatron-core uses in its schedules, p2p layer and embedding set-up
        counter = torch.zeros([], dtype=torch.int, device="cuda")
        shape = torch.empty((3,), device=torch.cuda.current_device(), dtype=torch.int64)
        moved = torch.ones(2).cuda()
        torch.cuda.synchronize()
        return counter, shape, moved

    counter, shape, moved = _on_cpu(megatron_like)()
    assert {t.device.type for t in (counter, shape, moved)} == {"cpu"}
    assert counter.dtype == torch.int and shape.shape == (3,) and torch.equal(moved, torch.ones(2))
    with pytest.raises((RuntimeError, AssertionError)):  # outside: CUDA is still absent, as before
        torch.zeros(1, device="cuda")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


def test_apply_cpu_shim_wraps_megatrons_schedules_once():
    from megatron.core.pipeline_parallel import schedules

    from slime_sparse.backends.megatron.cpu_shim import apply_cpu_shim

    assert apply_cpu_shim() and apply_cpu_shim()  # idempotent
    for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving"):
        fn = getattr(schedules, name)
        assert getattr(fn, "__slime_cpu_shim__", False), name
        assert not getattr(fn.__wrapped__, "__slime_cpu_shim__", False), f"{name} wrapped twice"
    assert schedules.get_forward_backward_func(pp_size=2, vp_size=None) is \
        schedules.forward_backward_pipelining_without_interleaving
