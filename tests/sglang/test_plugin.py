"""Plugin wiring: config transport, start-up preconditions, hook behaviour, and (marker `sglang`) the real
HookRegistry of the pinned SGLang applying every hook on CPU.

Slow set: `python -m pytest -q -p no:cacheprovider -m sglang tests/sglang/test_plugin.py`.
"""
from __future__ import annotations

import json
import pkgutil
from types import SimpleNamespace

import pytest
import torch

from sglang_patches import hooks
from sglang_patches.hooks import (
    HOOKS,
    after_forward_batch_init_new,
    around_prepare_for_decode,
    around_radix_attention_forward,
    hook_installed,
)
from sglang_patches.preconditions import (
    SparseKVPreconditionError,
    check_model_runner,
    check_server_args,
    raise_if_problems,
)
from sglang_patches.evictions import EVICTIONS_INFO_KEY, RETRACTED
from sglang_patches.runtime import EVICTED_ATTR, RING_ATTR, RUNTIME_ATTR
from sglang_patches.settings import ENV_VAR, config_from_environ, decode_config, encode_config
from slime_sparse.kv import KVCompressConfig

CFG = KVCompressConfig(method="rkv", budget=32, buffer=8, window=4, granularity="model")


# ----------------------------------------------------------------------------------------------------------------
# settings
# ----------------------------------------------------------------------------------------------------------------
def test_config_round_trips_through_the_environment():
    env = {ENV_VAR: encode_config(CFG)}
    assert config_from_environ(env) == CFG
    assert config_from_environ({}) is None
    assert config_from_environ({ENV_VAR: encode_config(KVCompressConfig(method="none", granularity="model"))}) is None


def test_config_refuses_per_head_selection_and_bad_input():
    with pytest.raises(ValueError, match="--kv-granularity='head'"):
        encode_config(KVCompressConfig(method="rkv", granularity="head"))
    with pytest.raises(ValueError, match="--kv-budget"):
        decode_config(json.dumps({"method": "rkv", "budget": 4, "window": 8, "granularity": "model"}))
    with pytest.raises(ValueError, match="unknown KVCompressConfig fields"):
        decode_config(json.dumps({"method": "rkv", "granularity": "model", "bogus": 1}))
    with pytest.raises(ValueError, match="not valid JSON"):
        decode_config("{")


# ----------------------------------------------------------------------------------------------------------------
# preconditions
# ----------------------------------------------------------------------------------------------------------------
def good_server_args(**overrides):
    graphs = SimpleNamespace(prefill=SimpleNamespace(backend="disabled"), decode=SimpleNamespace(backend="full"))
    args = dict(page_size=1, disable_radix_cache=True, disable_overlap_schedule=True, enable_mixed_chunk=False,
                speculative_algorithm=None, tp_size=1, pp_size=1, enable_dp_attention=False,
                enable_torch_compile=False, kv_cache_dtype="auto", attention_backend="fa3",
                disaggregation_mode="null", cuda_graph_config=graphs)
    args.update(overrides)
    return SimpleNamespace(**args)


def test_supported_server_args_pass():
    assert check_server_args(good_server_args()) == []


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"page_size": 16}, "--page-size 1"),
        ({"disable_radix_cache": False}, "--disable-radix-cache"),
        ({"disable_overlap_schedule": False}, "--disable-overlap-schedule"),
        ({"speculative_algorithm": "EAGLE"}, "speculative decoding off"),
        ({"tp_size": 2}, "--tp-size 1"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype"),
        ({"attention_backend": "trtllm_mha"}, "--attention-backend"),
        ({"cuda_graph_config": SimpleNamespace(prefill=SimpleNamespace(backend="breakable"),
                                               decode=SimpleNamespace(backend="full"))}, "--cuda-graph-backend-prefill"),
    ],
)
def test_each_unsupported_flag_is_named(override, needle):
    problems = check_server_args(good_server_args(**override))
    assert len(problems) == 1 and needle in problems[0]
    with pytest.raises(SparseKVPreconditionError, match="refuses to start"):
        raise_if_problems(problems, "server arguments")


def _named(cls_name: str, **attrs):
    return type(cls_name, (), attrs)()


def good_model_runner(**overrides):
    pool = _named("MHATokenToKVPool", kv_cache_layout="nhd", store_dtype=torch.bfloat16, dtype=torch.bfloat16)
    mha = SimpleNamespace(attention_arch=SimpleNamespace(name="MHA"))
    runner = dict(server_args=good_server_args(), model_config=mha,
                  is_hybrid_swa=False, mambaish_config=None, model_is_mrope=False, is_draft_worker=False,
                  req_to_token_pool=_named("ReqToTokenPool"), token_to_kv_pool=pool,
                  token_to_kv_pool_allocator=_named("TokenToKVPoolAllocator"))
    runner.update(overrides)
    return SimpleNamespace(**runner)


def test_model_runner_checks():
    assert check_model_runner(good_model_runner()) == []
    mla = good_model_runner(model_config=SimpleNamespace(attention_arch=SimpleNamespace(name="MLA")))
    assert any("MHA/GQA" in p for p in check_model_runner(mla))
    paged = good_model_runner(token_to_kv_pool_allocator=_named("PagedTokenToKVPoolAllocator"))
    assert any("TokenToKVPoolAllocator" in p for p in check_model_runner(paged))
    fp8 = good_model_runner(token_to_kv_pool=_named("MHATokenToKVPool", kv_cache_layout="nhd",
                                                    store_dtype=torch.uint8, dtype=torch.float8_e4m3fn))
    assert any("fp8" in p for p in check_model_runner(fp8))
    unresolved = good_model_runner(server_args=good_server_args(attention_backend=None))
    assert any("resolved to None" in p for p in check_model_runner(unresolved))


# ----------------------------------------------------------------------------------------------------------------
# hooks (with a stand-in runtime that records calls)
# ----------------------------------------------------------------------------------------------------------------
class RecordingRuntime:
    def __init__(self):
        self.calls: list[str] = []

    def compact_batch(self, batch):
        self.calls.append("compact")

    def record_kept(self, batch):
        self.calls.append("record")

    def logical_decode_positions(self, positions, reqs):
        return positions + 100

    def start_prefill(self, reqs):
        self.calls.append("prefill")


class Mode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode

    def is_none(self):  # doubles as spec_algorithm
        return True


@pytest.fixture
def runtime():
    return RecordingRuntime()


def pool(runtime=None):
    """A ReqToTokenPool stand-in: the object the hooks find this process's runtime on (none: compression off)."""
    return SimpleNamespace(**({RUNTIME_ATTR: runtime} if runtime is not None else {}))


def test_prepare_for_decode_compacts_before_sglang_allocates_and_records_after(runtime):
    def original(batch):
        runtime.calls.append("sglang")
        return "done"

    batch = SimpleNamespace(spec_algorithm=Mode(True), req_to_token_pool=pool(runtime))
    assert around_prepare_for_decode(original, batch) == "done"
    assert runtime.calls == ["compact", "sglang", "record"]


def test_hooks_are_inert_without_runtime():
    calls = []
    around_prepare_for_decode(lambda b: calls.append("sglang"), SimpleNamespace(req_to_token_pool=pool()))
    out = SimpleNamespace(forward_mode=Mode(True), positions=torch.tensor([3]))
    model_runner = SimpleNamespace(req_to_token_pool=pool())
    assert after_forward_batch_init_new(out, None, SimpleNamespace(reqs=[]), model_runner).positions.tolist() == [3]
    layer = SimpleNamespace(layer_id=0)  # no ring
    assert around_radix_attention_forward(lambda *a: "attn", layer, "q", "k", "v", "fb") == "attn"
    assert calls == ["sglang"]


def test_init_new_shifts_decode_positions_and_restarts_retracted_requests_at_prefill(runtime):
    model_runner = SimpleNamespace(req_to_token_pool=pool(runtime))
    decode = SimpleNamespace(forward_mode=Mode(True), positions=torch.tensor([3, 4]))
    extend = SimpleNamespace(forward_mode=Mode(False), positions=torch.tensor([3, 4]))
    batch = SimpleNamespace(reqs=[])
    assert after_forward_batch_init_new(decode, None, batch, model_runner).positions.tolist() == [103, 104]
    assert after_forward_batch_init_new(extend, None, batch, model_runner).positions.tolist() == [3, 4]
    assert runtime.calls == ["prefill"]


def test_a_retracted_request_restarts_dense_at_its_reprefill():
    """Retraction leaves the request's evicted count; its dense re-prefill (an extend batch: the only way a request
    that evicted tokens is prefilled) resets it and marks its record, at the index of the token that prefill makes."""
    from sglang_patches.runtime import SparseKVRuntime

    retracted = SimpleNamespace(customized_info=None, output_ids=[4, 5], **{EVICTED_ATTR: 12})
    fresh = SimpleNamespace(customized_info=None, output_ids=[], **{EVICTED_ATTR: 0})
    SparseKVRuntime.start_prefill([retracted, fresh])
    assert getattr(retracted, EVICTED_ATTR) == 0 and getattr(fresh, EVICTED_ATTR) == 0
    assert retracted.customized_info == {EVICTIONS_INFO_KEY: [0, 0, RETRACTED]}  # its record ends being one
    assert fresh.customized_info is None


def test_attention_hook_captures_into_the_layers_ring_then_runs_the_original():
    ring = torch.zeros(3, 4, 2, 5)  # [rows, window, Hq, d]
    layer = SimpleNamespace(layer_id=5, **{RING_ATTR: ring})
    fb = SimpleNamespace(forward_mode=Mode(True), req_pool_indices=torch.tensor([2, 1]), positions=torch.tensor([9, 2]))
    q = torch.randn(2, 10)

    def original(*args, **kwargs):
        return ("attn", args[1:4], kwargs)

    out = around_radix_attention_forward(original, layer, q, "k", "v", fb, save_kv_cache=False)
    assert out[0] == "attn" and out[1][0] is q and out[2] == {"save_kv_cache": False}
    assert torch.equal(ring[2, 1], q[0].view(2, 5)) and torch.equal(ring[1, 2], q[1].view(2, 5))  # slot = pos % 4
    assert int(ring.ne(0).any(dim=(-1, -2)).sum()) == 2


# ----------------------------------------------------------------------------------------------------------------
# the real HookRegistry of the pinned SGLang, on CPU
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_hook_registry_applies_every_hook(monkeypatch):
    from sglang_patches.source import activate_cpu_import_env, prepare_cpu_import_env

    activate_cpu_import_env(prepare_cpu_import_env())
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_patches.plugin import register

    for spec in HOOKS:  # monkeypatch restores the unhooked attributes at teardown: no double wrapping later
        owner, name = spec.target.rsplit(".", 1)
        cls = pkgutil.resolve_name(owner)
        monkeypatch.setattr(cls, name, cls.__dict__[name])
    monkeypatch.setenv(ENV_VAR, encode_config(CFG))
    originals = {}
    for spec in HOOKS:
        owner, name = spec.target.rsplit(".", 1)
        originals[spec.target] = pkgutil.resolve_name(owner).__dict__[name]
    with pytest.raises(SparseKVPreconditionError, match="were not applied"):
        hooks.verify_hooks_applied()  # nothing applied yet
    HookRegistry.reset()
    register()
    HookRegistry.apply_hooks()
    hooks.verify_hooks_applied()  # raises if any target failed to resolve or patch
    for spec in HOOKS:
        owner, name = spec.target.rsplit(".", 1)
        assert pkgutil.resolve_name(owner).__dict__[name] is not originals[spec.target], spec.target
        assert hook_installed(spec)

    # the hooked prepare_for_decode really runs ours: it finds the runtime on the batch's pool and compacts first
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    recorder = RecordingRuntime()
    batch = ScheduleBatch.__new__(ScheduleBatch)
    batch.spec_algorithm, batch.req_to_token_pool = Mode(True), pool(recorder)
    monkeypatch.setattr(recorder, "compact_batch", lambda b: (recorder.calls.append("compact"), 1 / 0))
    with pytest.raises(ZeroDivisionError):
        batch.prepare_for_decode()
    assert recorder.calls == ["compact"]

    # and a target without our hook is reported, not ignored
    owner, name = HOOKS[0].target.rsplit(".", 1)
    monkeypatch.setattr(pkgutil.resolve_name(owner), name, originals[HOOKS[0].target])
    with pytest.raises(SparseKVPreconditionError, match="were not applied") as failure:
        hooks.verify_hooks_applied()
    assert HOOKS[0].target in str(failure.value) and HOOKS[1].target not in str(failure.value)
    HookRegistry.reset()


@pytest.mark.sglang
@pytest.mark.slow
def test_dense_opt_out_reaches_sglangs_own_request_object():
    """/generate's custom_params -> SamplingParams -> msgpack IPC to the scheduler -> Req: what wants_dense reads."""
    from sglang_patches.source import activate_cpu_import_env, prepare_cpu_import_env

    activate_cpu_import_env(prepare_cpu_import_env())
    import msgspec
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_patches.runtime import wants_dense
    from sglang_patches.settings import DENSE_REQUEST_PARAM
    from slime_sparse.rollout.sglang.client import dense_request_params, sampling_payload
    from slime_sparse.rollout.sampling import SamplingParams as OurParams

    sent = json.loads(json.dumps(sampling_payload(OurParams(max_new_tokens=4), 7, dense_request_params())))
    params = SamplingParams(**sent)
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)  # tokenizer -> scheduler
    req = Req("r", "", [1, 2, 3], params)
    assert req.sampling_params.custom_params[DENSE_REQUEST_PARAM] is True and wants_dense(req)
    plain = Req("p", "", [1, 2, 3], SamplingParams(**json.loads(json.dumps(sampling_payload(OurParams(), 7)))))
    assert not wants_dense(plain)


@pytest.mark.sglang
@pytest.mark.slow
def test_start_up_hook_builds_the_runtime_on_sglangs_pools_and_layers(monkeypatch):
    """after_alloc_memory_pool on a model runner holding SGLang's own pools and RadixAttention layers: the runtime
    hangs on the ReqToTokenPool, each layer holds its ring, and the hooked RadixAttention.forward writes into it
    before SGLang's attention runs."""
    from sglang_patches.source import activate_cpu_import_env, prepare_cpu_import_env

    activate_cpu_import_env(prepare_cpu_import_env())
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_patches.plugin import register
    from tests.helpers.sglang_pools import sglang_pools

    for spec in HOOKS:
        owner, name = spec.target.rsplit(".", 1)
        cls = pkgutil.resolve_name(owner)
        monkeypatch.setattr(cls, name, cls.__dict__[name])
    monkeypatch.setenv(ENV_VAR, encode_config(CFG))
    HookRegistry.reset()
    register()
    HookRegistry.apply_hooks()
    req_to_token_pool, kv_pool, allocator = sglang_pools(rows=3, size=64, layers=2, kv_heads=2, head_dim=8,
                                                         max_len=96)
    layers = torch.nn.ModuleList([RadixAttention(4, 8, 1.0, 2, layer_id=i) for i in range(2)])
    runner = SimpleNamespace(
        server_args=good_server_args(enable_memory_saver=False), model=layers, dtype=torch.float32,
        model_config=SimpleNamespace(attention_arch=SimpleNamespace(name="MHA"), num_attention_heads=4),
        is_hybrid_swa=False, mambaish_config=None, model_is_mrope=False, is_draft_worker=False,
        req_to_token_pool=req_to_token_pool, token_to_kv_pool=kv_pool, token_to_kv_pool_allocator=allocator)
    from sglang_patches.hooks import after_alloc_memory_pool

    after_alloc_memory_pool(None, runner)
    runtime = getattr(req_to_token_pool, RUNTIME_ATTR)
    assert runtime.rings.shape == (2, 4, CFG.window, 4, 8)  # layers, req rows (padding row too), window, Hq, d
    assert all(getattr(layer, RING_ATTR).data_ptr() == runtime.rings[i].data_ptr() for i, layer in enumerate(layers))
    fb = SimpleNamespace(forward_mode=Mode(True), req_pool_indices=torch.tensor([2]), positions=torch.tensor([5]))
    q = torch.randn(1, 32)
    with pytest.raises(Exception):  # no attention backend on this CPU: SGLang's own forward cannot run
        layers[1](q, torch.randn(1, 16), torch.randn(1, 16), fb)
    assert torch.equal(runtime.rings[1, 2, 5 % CFG.window], q.view(4, 8))
    assert runtime.rings[0].eq(0).all()
    HookRegistry.reset()
