"""SGLang rollout engine against fake SGLang HTTP servers on 127.0.0.1 (tests/helpers/sglang_fakes.py; they stop with the
test). The fakes answer in the pinned SGLang's wire format (sglang_patches.contract checks the real one) and record
every call, so the order of control calls and the exact requests are checked here.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from tests.helpers.sglang_fakes import FakeSGLang

from sglang_patches.evictions import EVICTIONS_INFO_KEY, RETRACTED, eviction_entry
from sglang_patches.settings import DENSE_REQUEST_PARAM
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.sampling import SamplingParams, derive_seed
from slime_sparse.rollout.sglang import (
    SGLangClient,
    SGLangEngineConfig,
    SGLangHTTPError,
    SGLangRolloutEngine,
    ServerGroup,
    TensorWeightSync,
    budgeted_cache_flags,
    kv_stats_from_kept,
    server_command,
    server_env,
    split_passthrough,
)
from slime_sparse.rollout.sglang.client import parse_generate_response
from slime_sparse.rollout.sglang.launch import wait_port_free

KV = KVCompressConfig(method="rkv", budget=6, buffer=2, window=2, granularity="model")
DENSE = KVCompressConfig(method="none")


@pytest.fixture
def fake():
    with FakeSGLang() as server:
        yield server


def expected_tokens(prompt: list[int], seed: int, index: int, n: int) -> list[int]:
    """The fake's tokens for sample `index` of a call seeded `seed` (re-derived from its formula)."""
    base = sum(prompt) + derive_seed(seed, index) % 1000
    return [(base + k) % 50 for k in range(n)]


def test_generate_returns_tokens_logprobs_and_kv_accounting_in_order(fake):
    engine = SGLangRolloutEngine([fake.url], KV, timeout_s=10)
    prompts = [[1, 2, 3], [4, 5], [7]]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=(9,))
    outs = engine.generate(prompts, params, seed=11)
    assert [o.prompt_ids for o in outs] == prompts
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.response_ids == expected_tokens(prompt, 11, i, 5)
        assert out.logprobs == pytest.approx([-0.1 * (k + 1) for k in range(5)])
        assert out.finish_reason == "length" and out.weight_version == 0
    # request format: token ids, return_logprob, per-sample seed, stop ids
    sent = sorted((r for r in fake.requests if r["path"] == "/generate"), key=lambda r: r["input_ids"])
    assert all(r["return_logprob"] is True for r in sent)
    by_prompt = {tuple(r["input_ids"]): r["sampling_params"] for r in sent}
    assert by_prompt[(1, 2, 3)]["sampling_seed"] == derive_seed(11, 0)
    assert by_prompt[(7,)]["stop_token_ids"] == [9] and by_prompt[(7,)]["top_k"] == -1
    assert all("custom_params" not in sp for sp in by_prompt.values())  # the servers' own KV config
    # KV from meta_info: prompt [1, 2, 3] reads caches 3, 4, 5, 6, 7; the fake compresses 8 -> 6 only later
    assert outs[0].kv.dense_kv_tokens == 3 + 4 + 5 + 6 + 7 == outs[0].kv.kept_kv_tokens


def test_index_offset_gives_the_seeds_of_the_whole_call(fake):
    """A shard [2, 4) of a call seeded 5 draws exactly what samples 2 and 3 of the whole call draw."""
    engine = SGLangRolloutEngine([fake.url], KV, timeout_s=10)
    prompts = [[3, 1], [4, 1, 5], [9], [2, 6]]
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    whole = engine.generate(prompts, params, seed=5)
    shard = engine.generate(prompts[2:], params, seed=5, index_offset=2)
    assert [o.response_ids for o in shard] == [o.response_ids for o in whole[2:]]
    assert shard[1].response_ids == expected_tokens(prompts[3], 5, 3, 4)


def test_attached_servers_share_the_requests_in_turn():
    with FakeSGLang() as a, FakeSGLang() as b:
        cfg = SGLangEngineConfig(server_urls=(a.url, b.url), request_timeout_s=10)
        engine = SGLangRolloutEngine.from_config(cfg, KV, log_dir=None)
        prompts = [[i + 1] for i in range(5)]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=2), seed=1)
        assert [o.prompt_ids for o in outs] == prompts
        assert sorted(r["input_ids"][0] for r in a.requests) == [1, 3, 5]  # requests 0, 2, 4
        assert sorted(r["input_ids"][0] for r in b.requests) == [2, 4]
        engine.close()  # attached servers keep running
        assert SGLangClient(a.url, timeout_s=5).health()


def test_dense_evaluation_is_a_per_request_opt_out(fake):
    engine = SGLangRolloutEngine([fake.url], KV, timeout_s=10)
    view = engine.with_kv(DENSE)
    outs = view.generate([[1, 2]], SamplingParams(max_new_tokens=3), seed=3)
    (req,) = [r for r in fake.requests if r["path"] == "/generate"]
    assert req["sampling_params"]["custom_params"] == {DENSE_REQUEST_PARAM: True}
    assert outs[0].weight_version == view.weight_version == 0
    assert engine.with_kv(KV).engine is engine and engine.request_params(KV) is None  # its own config: no field
    other = KVCompressConfig(method="snapkv", budget=10, buffer=2, window=2, granularity="model")
    with pytest.raises(ValueError, match="--kv-method=snapkv"):
        engine.with_kv(other)
    dense_server = SGLangRolloutEngine([fake.url], None, timeout_s=10)
    assert dense_server.request_params(DENSE) is None  # nothing to opt out of
    with pytest.raises(ValueError, match="--kv-method=rkv"):
        dense_server.with_kv(KV)


def test_kv_stats_from_kept_counts_compressions_and_savings():
    stats = kv_stats_from_kept(prompt_len=6, kept=[6, 7, 8, 7, 8, 7], n_tokens=6)
    assert stats.dense_kv_tokens == sum(range(6, 12))  # 6 + 7 + ... + 11
    assert stats.kept_kv_tokens == 43 and stats.peak_kv_tokens == 8 and stats.compressions == 2
    assert stats.savings == pytest.approx(1 - 43 / 51)
    dense = kv_stats_from_kept(prompt_len=4, kept=None, n_tokens=3)
    assert dense.kept_kv_tokens == dense.dense_kv_tokens == 4 + 5 + 6 and dense.compressions == 0
    with pytest.raises(SGLangHTTPError, match="entries"):
        kv_stats_from_kept(prompt_len=4, kept=[4, 5], n_tokens=3)


def test_samples_carry_the_eviction_record_the_server_shipped(fake):
    """The fake cuts its cache 8 -> 6 keeping 2 sinks and the 4 most recent tokens: prompt [1, 2, 3] and 12 tokens
    compress after 8, 10 and 12 processed tokens (cache sizes 3, 4, ..., 8, 7, 8, 7, 8, 7, 8, 7)."""
    engine = SGLangRolloutEngine([fake.url], KV, timeout_s=10)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12), seed=0)[0]
    record = out.evictions
    assert record.starts.tolist() == [8, 10, 12] and record.shape == (1, 1, 6)
    assert record.kept_positions()[:, 0, 0].tolist() == [[0, 1, s - 4, s - 3, s - 2, s - 1] for s in (8, 10, 12)]
    assert out.kv.compressions == 3
    short = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5), seed=0)[0]
    assert short.evictions is None and short.kv.compressions == 0  # never compressed: a dense sample


def _answer(meta_extra: dict) -> dict:
    n = 4
    meta = {"id": "rid-7", "finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 5, None]] * n,
            "sparse_kv_kept": [9, 10, 9, 10], **meta_extra}
    return {"output_ids": [5] * n, "meta_info": meta}


def test_a_retracted_request_comes_without_record_and_bad_entries_name_the_request(caplog):
    entry = eviction_entry(9, 9, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))
    ok = parse_generate_response(list(range(8)), _answer({EVICTIONS_INFO_KEY: [0, 0, entry]}), True, 0)
    assert ok.evictions.starts.tolist() == [9] and ok.kv.compressions == 1
    with caplog.at_level("WARNING"):
        retracted = parse_generate_response(list(range(8)), _answer({EVICTIONS_INFO_KEY: [0, 0, entry, RETRACTED]}),
                                            True, 0)
    assert retracted.evictions is None and retracted.kv.compressions == 1  # a shadow loss will refuse it
    assert "rid-7" in caplog.text and "retracted" in caplog.text
    with pytest.raises(SGLangHTTPError, match="request rid-7: .*sparse_kv_evictions.*an event was lost"):
        parse_generate_response(list(range(8)), _answer({EVICTIONS_INFO_KEY: [0, 0, [9, 7, entry[2]]]}), True, 0)
    late = eviction_entry(11, 11, torch.arange(8))  # after more tokens than the sequence has before its last step
    with pytest.raises(SGLangHTTPError, match="request rid-7: a compression after 11 tokens of a 11-token"):
        parse_generate_response(list(range(7)), _answer({EVICTIONS_INFO_KEY: [0, late]}), True, 0)


def test_engine_refuses_a_server_without_the_plugin():
    with FakeSGLang(with_kept=False) as server:
        engine = SGLangRolloutEngine([server.url], KV, timeout_s=10)
        with pytest.raises(SGLangHTTPError, match="does not run the sglang_patches plugin"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))
        dense_engine = SGLangRolloutEngine([server.url], None, timeout_s=10)
        out = dense_engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))[0]
        assert out.kv.kept_kv_tokens == out.kv.dense_kv_tokens == 2 + 3 + 4


def test_tensor_update_pauses_loads_flushes_and_continues(fake):
    engine = SGLangRolloutEngine([fake.url], KV, weight_sync=TensorWeightSync(bucket_bytes=20), timeout_s=10)
    big = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"a": torch.ones(2), "b": big[:, 1],  # a strided view: only its own 3 values may travel
             "c": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)}
    fake.flush_refusals = 1  # SGLang refuses a flush while aborted requests drain: the client retries
    engine.update_weights(state)
    assert engine.weight_version == 1
    updates = [r for r in fake.requests if r["path"] == "/update_weights_from_tensor"]
    assert len(updates) == 2  # 20-byte buckets: a (8 bytes) + b (12) fill one, c (6) opens the next
    assert all(u["weight_version"] == "1" and u["flush_cache"] is False for u in updates)
    assert fake.calls[0] == "/pause_generation" and fake.calls[-3:] == ["/flush_cache"] * 2 + ["/continue_generation"]
    assert next(r for r in fake.requests if r["path"] == "/pause_generation")["mode"] == "retract"
    for name, t in state.items():
        assert torch.equal(fake.weights[name], t) and fake.weights[name].dtype == t.dtype
    assert fake.weights["b"].untyped_storage().nbytes() == 3 * 4
    # the server now reports version "1", which the engine expects from here on
    assert engine.generate([[1]], SamplingParams(max_new_tokens=2))[0].weight_version == 1


def test_a_server_that_missed_an_update_is_refused(fake):
    class Dropped:
        def push(self, clients, state_dict, version):  # loses the weights: the server keeps "default"
            pass

    engine = SGLangRolloutEngine([fake.url], KV, weight_sync=Dropped(), timeout_s=10)
    engine.update_weights({"a": torch.ones(1)})
    with pytest.raises(SGLangHTTPError, match="weight version 'default'.*holds 1"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="not newer"):
        engine.update_weights({"a": torch.ones(1)}, version=1)


def test_a_failed_load_still_resumes_generation_and_keeps_the_version(fake):
    class Broken:
        def push(self, clients, state_dict, version):
            raise RuntimeError("broadcast lost")

    engine = SGLangRolloutEngine([fake.url], KV, weight_sync=Broken(), timeout_s=10)
    with pytest.raises(RuntimeError, match="broadcast lost"):
        engine.update_weights({"a": torch.ones(1)})
    assert fake.calls == ["/pause_generation", "/continue_generation"]  # no flush of half-loaded weights
    assert engine.weight_version == 0


def test_flush_gives_up_with_the_servers_answer(fake):
    fake.flush_refusals = 5
    with pytest.raises(SGLangHTTPError, match="/flush_cache -> HTTP 400.*pending requests"):
        SGLangClient(fake.url, timeout_s=5).flush_cache(attempts=3, wait_s=0.01)


def test_http_errors_are_raised_with_the_path(fake):
    with pytest.raises(SGLangHTTPError, match="/update_weights_from_distributed -> HTTP 400.*flattened buckets only"):
        SGLangClient(fake.url, timeout_s=5).update_weights_from_distributed(["a"], ["float32"], [[1]], "g", "1",
                                                                           load_format=None)
    assert SGLangClient(fake.url, timeout_s=5).health()


def test_engine_rejects_per_head_selection():
    with pytest.raises(ValueError, match="--kv-granularity"):
        SGLangRolloutEngine(["http://127.0.0.1:1"], KVCompressConfig(method="rkv", granularity="head"))


def test_server_command_and_env_carry_the_budgeted_cache():
    cfg = SGLangEngineConfig(model_path="/m", load_format="dummy", cuda_graph=False,
                             extra_args=["--max-total-tokens", "4096"])
    cmd = server_command(cfg, 30001, KV)
    flags = ("--skip-tokenizer-init", "--disable-radix-cache", "--disable-overlap-schedule", "--disable-decode-cuda-graph")
    for flag in flags:
        assert flag in cmd
    assert cmd[cmd.index("--page-size") + 1] == "1" and cmd[cmd.index("--tp-size") + 1] == "1"
    assert cmd[cmd.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert cmd[-2:] == ["--max-total-tokens", "4096"]
    assert budgeted_cache_flags(None) == [] and "--page-size" not in server_command(cfg, 30001, None)
    env = server_env(KV, gpu_id=3, base={"SLIME_SPARSE_KV_CONFIG": "stale"})
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert json.loads(env["SLIME_SPARSE_KV_CONFIG"])["budget"] == 6
    assert "SLIME_SPARSE_KV_CONFIG" not in server_env(None, 0, base={"SLIME_SPARSE_KV_CONFIG": "stale"})


def test_passthrough_flags(tmp_path):
    """Unknown --sglang-X flags reach the servers as --X; ours land in the run config's sglang section."""
    from slime_sparse.config_loader import load_config

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1 2=", "label": "3"}\n')
    argv = ["--hf-checkpoint", str(tmp_path), "--prompt-data", str(data), "--lr", "1e-6",
            "--sglang-num-servers", "2", "--sglang-max-total-tokens", "8192",
            "--sglang-enable-metrics", "--sglang-log-level=warning", "--sglang-gpu-ids", "4,5",
            "--sglang-server-urls", "http://a:1,http://b:2"]
    cfg = load_config(argv).sglang
    assert cfg.extra_args == ("--max-total-tokens", "8192", "--enable-metrics", "--log-level=warning")
    assert cfg.num_servers == 2 and cfg.router_enabled and cfg.gpu_ids == (4, 5)
    assert cfg.server_urls == ("http://a:1", "http://b:2") and cfg.attached
    kept, passthrough = split_passthrough(["--lr", "1", "--sglang-x", "--sglang-y", "2"], {"--lr"})
    assert kept == ["--lr", "1"] and passthrough == ["--x", "--y", "2"]
    with pytest.raises(ValueError, match="--sglang-num-servers"):
        SGLangEngineConfig(model_path="/m", num_servers=0).validate()
    for urls in (("a:1",), ("http://a:1", "http://a:1")):
        with pytest.raises(ValueError, match="--sglang-server-urls"):
            SGLangEngineConfig(server_urls=urls).validate()
    with pytest.raises(ValueError, match="nothing to launch"):
        ServerGroup.launch(SGLangEngineConfig(model_path="/m", server_urls=("http://a:1",)), KV, tmp_path)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the parent-death signal and /proc are Linux's")
def test_launched_servers_die_with_their_launcher(tmp_path):
    """A Ray engine actor that dies must not leave servers holding its GPU: the launcher's children get SIGTERM."""
    script = (
        "import sys, os\n"
        "from pathlib import Path\n"
        "from slime_sparse.rollout.sglang.launch import ManagedProcess\n"
        "p = ManagedProcess.start('sleeper', [sys.executable, '-c', 'import time; time.sleep(60)'], dict(os.environ),"
        f" Path({str(tmp_path)!r}))\n"
        "print(p.process.pid, flush=True)\n"
        "os._exit(0)\n"  # dies without stopping its child
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def test_wait_port_free_waits_for_a_listener_to_go():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(TimeoutError, match=f"port {port}"):
            wait_port_free("127.0.0.1", port, timeout_s=0.3, poll_s=0.1)
    wait_port_free("127.0.0.1", port, timeout_s=5)  # closed: returns at once



def test_components_attach_and_evaluate_densely_on_the_same_servers(tmp_path):
    """Without Ray: --sglang-server-urls attaches (nothing launched), the servers join this process's weight group,
    and dense evaluation reuses them per request instead of starting a second server set."""
    from slime_sparse.components import Components
    from slime_sparse.factory import EngineSpec, build_engine
    from slime_sparse.config_loader import load_config
    from slime_sparse.rollout.base import KVView

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1 2=", "label": "3"}\n')
    with FakeSGLang() as fake:
        cfg = load_config(["--hf-checkpoint", str(tmp_path), "--prompt-data", str(data), "--device", "cpu",
                           "--rollout-engine", "sglang", "--sglang-server-urls", fake.url, "--kv-method", "rkv",
                           "--kv-budget", "6", "--kv-buffer", "2", "--kv-window", "2", "--kv-granularity", "model"])
        engine = build_engine(EngineSpec.from_run(cfg))
        (joined,) = fake.joined
        assert (joined["world_size"], joined["rank_offset"], joined["backend"]) == (2, 1, "gloo")
        comp = Components(cfg=cfg, tokenizer=None, stream=None, reward_fn=None, learner=None, engine=engine)
        view = comp.eval_engine("dense")
        assert isinstance(view, KVView) and view.engine is engine and comp.eval_engine("sparse") is engine
        weights = {"w": torch.randn(3, 2)}
        engine.update_weights(weights)
        assert torch.equal(fake.weights["w"], weights["w"]) and view.weight_version == 1
        view.generate([[1, 2]], SamplingParams(max_new_tokens=2), seed=0)
        assert fake.requests[-1]["sampling_params"]["custom_params"] == {DENSE_REQUEST_PARAM: True}
        comp.close()
