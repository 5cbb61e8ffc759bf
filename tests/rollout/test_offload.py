"""The trainer gets the concurrency (#43 item 4): a memory size alone admits what fits (the batch cap defaults to none),
--rollout-mem-fraction sizes it from the free memory, and --offload-rollout gives the KV cache back between rollouts
while the runner (its decode state and, on CUDA, its graphs) stays: the next rollout builds and captures nothing.

On CPU the cache lives in torch storages shrunk to nothing while released; on CUDA with graphs in virtual memory at
fixed addresses (utils/cuda_vmm.py), whose bookkeeping runs here against a fake driver that poisons the memory it
hands out, so that a cache not zeroed on resume would decode NaN. The real driver: tests/gpu/test_offload.py."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import slime_sparse.rollout.embedded.engine as engine_module
import slime_sparse.rollout.embedded.runner as runner_module
from slime_sparse.config_loader import load_config
from slime_sparse.factory import EngineSpec, build_engine
from slime_sparse.kv import KVCompressConfig, engine_memory, row_capacity
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.embedded.arena import FixedAddressArena, StorageArena
from slime_sparse.rollout.embedded.engine import DEFAULT_MAX_BATCH_SIZE
from slime_sparse.rollout.embedded.runner import row_bytes
from slime_sparse.rollout.offload import OffloadingEngine
from slime_sparse.utils import cuda_vmm

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
RKV = KVCompressConfig(method="rkv", budget=12, buffer=4, window=3, kernel_size=3)
H2O = KVCompressConfig(method="h2o", budget=12, buffer=4, window=3)  # its attention mass lives in the arena too
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True)


def model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.response_ids for o in outs]


class FakeDriver:
    """cuda_vmm's driver calls on host memory: each reserved range is a host buffer; physical memory is counted, and
    whatever a map hands out (like whatever an unmap leaves behind) is 0xFF bytes, a NaN in every float."""

    def __init__(self) -> None:
        self.backing: dict[int, torch.Tensor] = {}
        self.handles: dict[int, int] = {}  # live physical handle -> size
        self.mapped: dict[int, int] = {}  # ptr -> handle
        self.calls: list[str] = []

    @property
    def physical_bytes(self) -> int:
        return sum(self.handles.values())

    def granularity(self, device: int) -> int:
        return 4096

    def reserve(self, size: int, alignment: int) -> int:
        assert size % alignment == 0
        buf = torch.full((size,), 0xFF, dtype=torch.uint8)
        self.backing[buf.data_ptr()] = buf
        self.calls.append("reserve")
        return buf.data_ptr()

    def free(self, ptr: int, size: int) -> None:
        assert ptr not in self.mapped
        del self.backing[ptr]
        self.calls.append("free")

    def create(self, size: int, device: int) -> int:
        handle = len(self.calls) + 1
        self.handles[handle] = size
        self.calls.append("create")
        return handle

    def release(self, handle: int) -> None:
        del self.handles[handle]
        self.calls.append("release")

    def map(self, ptr: int, size: int, handle: int, device: int) -> None:
        assert ptr not in self.mapped and self.backing[ptr].numel() == size
        self.mapped[ptr] = handle
        self._poison(ptr)
        self.calls.append("map")

    def unmap(self, ptr: int, size: int) -> None:
        del self.mapped[ptr]
        self._poison(ptr)
        self.calls.append("unmap")

    @torch.inference_mode()
    def _poison(self, ptr: int) -> None:
        self.backing[ptr].fill_(0xFF)

    def as_tensor(self, block) -> torch.Tensor:
        return self.backing[block.ptr][: block.nbytes]


@pytest.fixture
def fake_vmm(monkeypatch):
    """Runners of memory_saver engines get a fixed-address arena over the fake driver (as on CUDA with graphs)."""
    driver = FakeDriver()
    monkeypatch.setattr(runner_module, "new_arena", lambda device, releasable, mode:
                        FixedAddressArena(device, driver) if releasable else StorageArena(device))
    return driver


# ---- the batch cap and the memory flags ----
def test_a_memory_size_alone_admits_what_fits():
    m = model()
    longest = 11 + PARAMS.max_new_tokens
    spec = EmbeddedEngine(m, RKV).memory_spec(RKV, row_capacity(RKV, longest))
    gib = sum(engine_memory.engine_bytes(spec, 100).values()) / 2**30  # 100 rows with every working set
    assert EmbeddedEngine(m, RKV).max_batch_size == DEFAULT_MAX_BATCH_SIZE  # no memory size: the old default
    alone = EmbeddedEngine(m, RKV, kv_cache_gib=gib)
    fit = EmbeddedEngine(m, RKV, kv_cache_gib=gib, max_batch_size=10**6).rows_for(RKV, longest)  # what fits, uncapped
    assert alone.max_batch_size is None and alone.rows_for(RKV, longest) == fit > DEFAULT_MAX_BATCH_SIZE
    assert EmbeddedEngine(m, RKV, kv_cache_gib=gib, max_batch_size=40).rows_for(RKV, longest) == 40


def test_mem_fraction_sizes_the_memory_from_what_is_free(monkeypatch):
    m = model()
    longest = 11 + PARAMS.max_new_tokens
    per_row = row_bytes(m.config, RKV, row_capacity(RKV, longest), torch.float32)
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda device: 200 * per_row)
    engine = EmbeddedEngine(m, RKV, mem_fraction=0.25)
    assert engine.kv_cache_gib == pytest.approx(50 * per_row / 2**30)
    assert engine.rows_for(RKV, longest) == EmbeddedEngine(m, RKV, kv_cache_gib=engine.kv_cache_gib).rows_for(
        RKV, longest) > 6
    out = engine.generate(prompts(6), PARAMS, seed=4)
    assert tokens(out) == tokens(EmbeddedEngine(m, RKV, max_batch_size=6).generate(prompts(6), PARAMS, seed=4))


def test_mem_fraction_on_cpu_reads_the_available_memory():
    from slime_sparse.utils.device import free_memory_bytes

    free = free_memory_bytes("cpu")
    assert 0 < free < 2**50
    engine = EmbeddedEngine(model(), RKV, mem_fraction=1e-4)
    assert 0.5 * 1e-4 * free < engine.kv_cache_gib * 2**30 < 2 * 1e-4 * free  # free memory moves a little meanwhile


@pytest.mark.parametrize("extra,message", [
    (["--rollout-kv-cache-gib", "8", "--rollout-mem-fraction", "0.5"],
     "--rollout-kv-cache-gib and --rollout-mem-fraction both size"),
    (["--rollout-mem-fraction", "1.5"], r"--rollout-mem-fraction=1.5 is invalid: must lie in \(0, 1\)"),
    (["--rollout-mem-fraction", "0"], r"--rollout-mem-fraction=0.0 is invalid"),
    (["--rollout-kv-cache-gib", "-1"], r"--rollout-kv-cache-gib=-1.0 is invalid: must be > 0"),
    (["--rollout-max-batch-size", "0"], r"--rollout-max-batch-size=0 is invalid: must be > 0"),
    (["--rollout-engine", "sglang", "--rollout-mem-fraction", "0.5"], "--sglang-mem-fraction-static"),
    (["--rollout-engine", "sglang", "--rollout-kv-cache-gib", "8"], "size the embedded engine"),
])
def test_bad_memory_flags_name_the_flag(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        load_config(_base_args(tmp_path) + extra)
    with pytest.raises(ValueError, match="--rollout-kv-cache-gib and --rollout-mem-fraction"):
        EmbeddedEngine(model(), kv_cache_gib=1.0, mem_fraction=0.5)


def _base_args(tmp_path) -> list[str]:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1 2=", "label": "3"}\n')
    model().save_pretrained(tmp_path / "model")
    return ["--prompt-data", str(data), "--hf-checkpoint", str(tmp_path / "model"), "--device", "cpu"]


@pytest.mark.parametrize("flags,rows", [
    ([], DEFAULT_MAX_BATCH_SIZE),  # no memory size: 64, as before
    (["--rollout-kv-cache-gib", "G"], "fit"),  # the memory alone: what fits (before: min(fit, 64) = 64)
    (["--rollout-kv-cache-gib", "G", "--rollout-max-batch-size", "32"], 32),  # an explicit cap still caps
    (["--rollout-mem-fraction", "F"], "fit"),  # a quarter of 400 rows' worth free: the same memory
])
def test_the_trainers_engine_admits_by_flag(tmp_path, monkeypatch, flags, rows):
    """The flags as the trainer passes them (config -> EngineSpec -> engine): the rows one generate() call of 200
    sequences decodes at once."""
    m = model()
    longest = 11 + PARAMS.max_new_tokens
    spec = EmbeddedEngine(m, RKV).memory_spec(RKV, row_capacity(RKV, longest))
    hundred = sum(engine_memory.engine_bytes(spec, 100).values())  # 100 rows with every working set
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda device: 4 * hundred)
    values = {"G": str(hundred / 2**30), "F": "0.25"}
    cfg = load_config(_base_args(tmp_path) + [values.get(f, f) for f in flags] + [
        "--kv-method", "rkv", "--kv-budget", "12", "--kv-buffer", "4", "--kv-window", "3", "--kv-kernel-size", "3"])
    engine = build_engine(EngineSpec.from_run(cfg))
    if rows == "fit":  # what 100 rows' bytes hold by the engine's own admission, uncapped: more than 64
        rows = EmbeddedEngine(m, cfg.kv, kv_cache_gib=float(values["G"]), max_batch_size=10**6).rows_for(cfg.kv, longest)
        assert rows > DEFAULT_MAX_BATCH_SIZE
    assert engine.rows_for(cfg.kv, longest) == rows
    assert engine.memory_saver == cfg.offloads_rollout  # in one process: on by default


# ---- release and resume ----
@pytest.mark.parametrize("kv", [KVCompressConfig(), RKV, H2O], ids=["dense", "rkv", "h2o"])
def test_the_runner_survives_release_and_resume(kv):
    m = model()
    batch = prompts(7, seed=1)
    reference = EmbeddedEngine(m, kv, max_batch_size=4).generate(batch, PARAMS, seed=5)
    engine = EmbeddedEngine(m, kv, max_batch_size=4, memory_saver=True)
    first = engine.generate(batch, PARAMS, seed=5)
    runner, arena = engine._runner, engine._runner.arena
    held = arena.nbytes
    assert isinstance(arena, StorageArena) and arena.resident_bytes == held > 0
    engine.release_memory()
    assert engine._runner is runner and arena.released and arena.resident_bytes == 0  # the cache went back
    engine.resume_memory()
    assert arena.resident_bytes == held and all(int(t.count_nonzero()) == 0 for t in arena.tensors)
    again = engine.generate(batch, PARAMS, seed=5)
    engine.release_memory()
    third = engine.generate(batch, PARAMS, seed=5)  # generate() takes the memory back itself
    assert tokens(first) == tokens(again) == tokens(third) == tokens(reference)
    assert engine.runner_builds == 1 and engine._runner is runner


def test_without_the_memory_saver_a_release_drops_the_runner():
    engine = EmbeddedEngine(model(), RKV, max_batch_size=4)
    engine.generate(prompts(4), PARAMS, seed=0)
    engine.release_memory()
    assert engine._runner is None
    engine.generate(prompts(4), PARAMS, seed=0)
    assert engine.runner_builds == 2


def test_offloaded_rollouts_build_one_runner():
    """--offload-rollout as the loop sees it: the engine gives its memory back after each rollout and takes it again
    before the next; the same tokens as an engine that keeps it, and one runner over three rollouts."""
    m = model()
    kept = EmbeddedEngine(m, RKV, max_batch_size=4)
    offloaded = OffloadingEngine(EmbeddedEngine(m, RKV, max_batch_size=4, memory_saver=True))
    for step in range(3):
        batch = prompts(6, seed=step)
        assert tokens(offloaded.generate(batch, PARAMS, seed=step)) == tokens(kept.generate(batch, PARAMS, seed=step))
        assert offloaded.engine._runner.released  # given back after each rollout
    assert offloaded.runner_builds == 1 and kept.runner_builds == 1


@pytest.mark.parametrize("kv", [KVCompressConfig(), RKV, H2O], ids=["dense", "rkv", "h2o"])
def test_fixed_address_arena_gives_physical_memory_back_and_keeps_addresses(fake_vmm, kv):
    m = model()
    batch = prompts(7, seed=2)
    reference = EmbeddedEngine(m, kv, max_batch_size=4).generate(batch, PARAMS, seed=6)
    engine = EmbeddedEngine(m, kv, max_batch_size=4, memory_saver=True)
    first = engine.generate(batch, PARAMS, seed=6)
    arena = engine._runner.arena
    assert isinstance(arena, FixedAddressArena)
    held = fake_vmm.physical_bytes
    assert held >= arena.nbytes > 0 and held == arena.resident_bytes
    addresses = [t.data_ptr() for t in arena.tensors]
    engine.release_memory()
    assert fake_vmm.physical_bytes == 0 and arena.resident_bytes == 0 and cuda_vmm.mapped_bytes() >= 0
    again = engine.generate(batch, PARAMS, seed=6)  # remapped over poisoned memory: zeroed, or it would decode NaN
    assert [t.data_ptr() for t in arena.tensors] == addresses  # what a captured graph reads is where it was
    assert fake_vmm.physical_bytes == held
    assert tokens(first) == tokens(again) == tokens(reference)
    assert all(all(lp == lp for lp in o.logprobs) for o in again)
    n_blocks = len(arena.blocks)
    del engine, arena
    import gc

    gc.collect()
    assert fake_vmm.calls.count("free") == n_blocks and fake_vmm.physical_bytes == 0  # the addresses too, at the end


def test_a_failed_resume_names_the_flags_and_maps_nothing(fake_vmm):
    engine = EmbeddedEngine(model(), RKV, max_batch_size=4, memory_saver=True)
    engine.generate(prompts(4), PARAMS, seed=0)
    engine.release_memory()
    original = fake_vmm.create
    count = {"n": 0}

    def create(size, device):  # the learner kept the memory: the second block finds none
        count["n"] += 1
        if count["n"] == 2:
            raise cuda_vmm.CudaDriverError("cuMemCreate", 2, "out of memory")
        return original(size, device)

    fake_vmm.create = create
    with pytest.raises(RuntimeError, match="--rollout-kv-cache-gib or --rollout-mem-fraction"):
        engine.resume_memory()
    assert fake_vmm.physical_bytes == 0 and engine._runner.released


def test_without_cuda_virtual_memory_the_runner_falls_back_to_torch_storages(caplog):
    """Where the driver's calls cannot be had (here: no libcuda), a graph runner's arena is torch's allocator, with a
    warning; the engine then drops such a runner on release (its graphs would point at freed memory)."""
    from slime_sparse.rollout.embedded.arena import new_arena

    with caplog.at_level("WARNING"):
        arena = new_arena(torch.device("cpu"), True, "cuda_graph")
    assert isinstance(arena, StorageArena) and not arena.keeps_addresses
    assert "capture the decode graphs again" in caplog.text
