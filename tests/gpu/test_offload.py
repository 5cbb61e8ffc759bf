"""--offload-rollout on a GPU (#43 item 4): the engine gives its KV cache back between rollouts and takes it again
without capturing its CUDA graphs again.

Skipped without CUDA (CI has none; the same logic runs on CPU in tests/rollout/test_offload.py against a fake driver);
`tools/gpu_checks.sh` runs them on the device machine. What they pin down:
- CUDA's virtual memory through ctypes (utils/cuda_vmm.py): a block keeps its address across unmap / map, and the
  device's free memory grows by the block while it is unmapped;
- an engine with memory_saver: after release the device has the cache's memory free, after resume the next call replays
  the graphs of the first (0 captures), at the same addresses, with the tokens of an engine that never let go;
- the training loop itself (benchmarks/rl_step_bench.py, tiny shape, 2 steps per mode, the engine offloaded as the
  trainer does in one process): the second step builds no runner and captures no graph.
"""
import json

import pytest
import torch

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.embedded.arena import FixedAddressArena
from slime_sparse.rollout.offload import OffloadingEngine
from slime_sparse.utils.cuda_vmm import FixedAddressBlock
from tests.helpers.gpu import CUDA_ONLY, make_model, prompts

pytestmark = CUDA_ONLY

RKV = KVCompressConfig(method="rkv", budget=48, buffer=16, window=8)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True)


def model():
    return make_model(torch.bfloat16)


def free_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def test_a_fixed_address_block_gives_its_memory_back_and_keeps_its_address():
    block = FixedAddressBlock(256 << 20, torch.cuda.current_device())
    t = block.tensor((256 << 20) // 2, torch.bfloat16).fill_(1.5)
    address, before = t.data_ptr(), free_bytes()
    torch.cuda.synchronize()
    block.unmap()
    assert free_bytes() - before >= block.size * 0.9  # the physical memory went back to the device
    block.map()
    t.zero_()
    assert t.data_ptr() == address and float(t.float().sum()) == 0.0
    t.fill_(2.0)
    assert float(t[:4].float().sum()) == 8.0


@pytest.mark.parametrize("kv", [KVCompressConfig(), RKV], ids=["dense", "rkv"])
def test_an_offloaded_engine_keeps_its_graphs_and_gives_its_cache_back(kv):
    m = model()
    batch = prompts(16)
    kept = EmbeddedEngine(m, kv, device="cuda", max_batch_size=16)
    engine = EmbeddedEngine(m, kv, device="cuda", max_batch_size=16, memory_saver=True)
    assert engine.step_mode == "cuda_graph"
    first = engine.generate(batch, PARAMS, seed=3)
    assert engine.last_stats.captures > 0
    arena = engine._runner.arena
    assert isinstance(arena, FixedAddressArena)
    addresses, before = [t.data_ptr() for t in arena.tensors], free_bytes()
    engine.release_memory()
    assert free_bytes() - before >= 0.9 * arena.nbytes  # the cache's memory is the device's again
    hog = torch.empty(arena.nbytes, dtype=torch.uint8, device="cuda").fill_(0xFF)  # the learner uses it meanwhile
    del hog
    engine.resume_memory()
    again = engine.generate(batch, PARAMS, seed=3)
    assert engine.last_stats.captures == 0 and engine.runner_builds == 1  # replayed, not captured
    assert [t.data_ptr() for t in arena.tensors] == addresses
    reference = kept.generate(batch, PARAMS, seed=3)
    for a, b, c in zip(first, again, reference):
        assert a.response_ids == b.response_ids == c.response_ids
        assert a.logprobs == b.logprobs == c.logprobs


def test_without_the_memory_saver_an_offloaded_engine_captures_every_rollout():
    """The control: the engine as it was (runner dropped on release) captures again after each release."""
    engine = OffloadingEngine(EmbeddedEngine(model(), RKV, device="cuda", max_batch_size=16))
    for _ in range(2):
        engine.generate(prompts(16), PARAMS, seed=0)
        assert engine.last_stats.captures > 0
    assert engine.runner_builds == 2


def test_two_offloaded_training_steps_capture_nothing_the_second_time(tmp_path):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "rl_step_bench.py"
    spec = importlib.util.spec_from_file_location("bench_rl_step_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "steps.jsonl"
    bench.main(["--shape", "tiny", "--device", "cuda", "--steps", "2", "--cache-dir", str(tmp_path / "model"),
                "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["step"]) for r in records] == [("dense", 0), ("dense", 1), ("sparse", 0), ("sparse", 1)]
    for r in records:
        if r["step"] == 0:
            assert r["runner_builds"] == 1 and r["captures"] > 0, r
        else:
            assert r["runner_builds"] == 0 and r["captures"] == 0, r
