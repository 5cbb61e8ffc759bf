"""The decode step and the compaction of every KV method are capture-safe (#33): run on the meta device (no data at
all) under `CaptureGuard`, they neither read the device from the host (item, nonzero, ...), nor lift host data into
device tensors (a Python scalar assigned through an index: H2O's mass reset once did, and crashed under CUDA graphs),
nor mix host tensors into device work (a host-to-device copy). One case per method; the first call of each shape runs
unguarded, as the capture's eager warm-up does (it may build small device constants once)."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from slime_sparse.kv import METHODS, KVCompressConfig
from slime_sparse.rollout import SamplingParams
from slime_sparse.rollout.embedded.attention import budget_attention_installed
from slime_sparse.rollout.embedded.runner import ModelRunner, RunnerShape
from slime_sparse.utils.lm_head import hf_head_weight, lm_head_logits
from slime_sparse.utils.op_audit import CaptureGuard

META = torch.device("meta")
ROWS, BUDGET, BUFFER, WINDOW = 4, 12, 4, 3


def meta_runner(kv: KVCompressConfig) -> tuple[torch.nn.Module, ModelRunner]:
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config).eval().to(META)
    head = hf_head_weight(model)
    budgets = (BUDGET, BUDGET) if kv.schedule == "uniform" else (BUDGET + 4, BUDGET - 4)
    shape = RunnerShape(kv, ROWS, BUDGET + 4 + BUFFER, "eager", 1)
    return model, ModelRunner(model, shape, budgets, META, lambda h: lm_head_logits(h, head, fp32=False))


def guarded(fn) -> CaptureGuard:
    fn()  # the warm-up call
    with CaptureGuard(META) as guard:
        fn()
    return guard


@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_capture_guard_decode_step_and_compaction(method):
    kv = KVCompressConfig(method=method, budget=BUDGET, buffer=BUFFER, window=WINDOW)
    model, runner = meta_runner(kv)
    capacity = runner.shape.capacity
    rows = torch.arange(ROWS, device=META)
    groups = {capacity: [0, 1]}
    with torch.inference_mode(), budget_attention_installed(model):
        for params in (SamplingParams(temperature=1.0, top_p=0.9, top_k=20), SamplingParams(temperature=0.0)):
            guarded(lambda: runner.step(ROWS, (capacity, capacity), params)).check()
        guard = guarded(lambda: runner.compressor._compact(rows, groups, WINDOW))
    guard.check()


def test_capture_guard_dense_decode_step():
    model, runner = meta_runner(KVCompressConfig())
    with torch.inference_mode(), budget_attention_installed(model):
        guarded(lambda: runner.step(3, (16, 16), SamplingParams(temperature=1.0))).check()


def test_the_guard_catches_what_breaks_a_capture():
    """The guard fails on each class of bug it exists for (so the cases above can fail)."""
    x = torch.zeros(4, 3, 5, device=META)
    rows, slots = torch.arange(4, device=META), torch.zeros(4, dtype=torch.int64, device=META)
    cases = {
        "python scalar through an index (H2O's old mass reset)": lambda: x.__setitem__((rows, slice(None), slots), 0.0),
        "host list to the device": lambda: torch.tensor([1, 2]).to(META),
        "host index into a device tensor": lambda: x[torch.tensor([0, 1])],
        "data-dependent shape": lambda: torch.zeros(3).nonzero(),
    }
    for name, fn in cases.items():
        with CaptureGuard(META) as guard:
            try:
                fn()
            except (NotImplementedError, RuntimeError):  # meta cannot compute it: the guard has seen it by then
                pass
        assert guard.violations, name
