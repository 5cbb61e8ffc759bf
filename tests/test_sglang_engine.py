"""SGLang rollout engine against a fake SGLang HTTP server on 127.0.0.1 (bounded: it stops with the test).

The fake answers in the pinned SGLang's wire format (sglang_patches.contract checks the real one): /generate with
output_ids and meta_info.output_token_logprobs entries [logprob, token_id, null], finish_reason {"type": ...},
and the plugin's per-token meta_info["sparse_kv_kept"]; control endpoints record the order they were called in.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.sampling import SamplingParams, derive_seed
from slime_sparse.rollout.sglang import (
    DistributedWeightSync,
    SGLangEngineConfig,
    SGLangHTTPError,
    SGLangRolloutEngine,
    budgeted_cache_flags,
    kv_stats_from_kept,
    server_command,
    server_env,
    split_passthrough,
)

KV = KVCompressConfig(method="rkv", budget=6, buffer=2, window=2, granularity="model")


def fake_generation(input_ids: list[int], sp: dict, with_kept: bool) -> dict:
    """Deterministic stand-in for SGLang: token t_i = (sum(prompt) + seed + i) % 50, budgeted cache B=6, b=2."""
    n = sp["max_new_tokens"]
    base = sum(input_ids) + sp.get("sampling_seed", 0) % 1000
    out = [(base + i) % 50 for i in range(n)]
    meta = {
        "id": "x",
        "finish_reason": {"type": "length", "length": n},
        "prompt_tokens": len(input_ids),
        "completion_tokens": n,
        "output_token_logprobs": [[-0.1 * (i + 1), t, None] for i, t in enumerate(out)],
    }
    if with_kept and n > 1:
        kept, cache = [len(input_ids)], len(input_ids)
        for _ in range(n - 1):
            cache = 6 if cache >= 8 else cache
            cache += 1
            kept.append(cache)
        meta["sparse_kv_kept"] = kept
    return {"output_ids": out, "meta_info": meta}


class FakeSGLang:
    def __init__(self, with_kept: bool = True):
        self.calls: list[str] = []
        self.requests: list[dict] = []
        self.with_kept = with_kept
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _reply(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                fake.calls.append(self.path)
                self._reply({})

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                payload = json.loads(self.rfile.read(length) or b"{}")
                fake.calls.append(self.path)
                fake.requests.append({"path": self.path, **payload})
                if self.path == "/generate":
                    self._reply(fake_generation(payload["input_ids"], payload["sampling_params"], fake.with_kept))
                elif self.path.startswith("/update_weights") or self.path == "/init_weights_update_group":
                    self._reply({"success": True, "message": "ok"})
                elif self.path == "/fail":
                    self._reply({"error": "nope"}, code=400)
                else:
                    self._reply({"status": "ok"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.timeout = 5
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def fake():
    with FakeSGLang() as server:
        yield server


def test_generate_returns_tokens_logprobs_and_kv_accounting_in_order(fake):
    engine = SGLangRolloutEngine([fake.url], KV, timeout_s=10)
    prompts = [[1, 2, 3], [4, 5], [7]]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=(9,))
    outs = engine.generate(prompts, params, seed=11)
    assert [o.prompt_ids for o in outs] == prompts
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        base = sum(prompt) + derive_seed(11, i) % 1000
        assert out.response_ids == [(base + k) % 50 for k in range(5)]
        assert out.logprobs == pytest.approx([-0.1 * (k + 1) for k in range(5)])
        assert out.finish_reason == "length" and out.weight_version == 0
    # request format: token ids, return_logprob, per-sample seed, stop ids
    sent = sorted((r for r in fake.requests if r["path"] == "/generate"), key=lambda r: r["input_ids"])
    assert all(r["return_logprob"] is True for r in sent)
    by_prompt = {tuple(r["input_ids"]): r["sampling_params"] for r in sent}
    assert by_prompt[(1, 2, 3)]["sampling_seed"] == derive_seed(11, 0)
    assert by_prompt[(7,)]["stop_token_ids"] == [9] and by_prompt[(7,)]["top_k"] == -1
    # KV from meta_info: prompt [1, 2, 3] reads caches 3, 4, 5, 6, 7; the fake compresses 8 -> 6 only later
    assert outs[0].kv.dense_kv_tokens == 3 + 4 + 5 + 6 + 7 == outs[0].kv.kept_kv_tokens


def test_kv_stats_from_kept_counts_compressions_and_savings():
    stats = kv_stats_from_kept(prompt_len=6, kept=[6, 7, 8, 7, 8, 7], n_tokens=6)
    assert stats.dense_kv_tokens == sum(range(6, 12))  # 6 + 7 + ... + 11
    assert stats.kept_kv_tokens == 43 and stats.peak_kv_tokens == 8 and stats.compressions == 2
    assert stats.savings == pytest.approx(1 - 43 / 51)
    dense = kv_stats_from_kept(prompt_len=4, kept=None, n_tokens=3)
    assert dense.kept_kv_tokens == dense.dense_kv_tokens == 4 + 5 + 6 and dense.compressions == 0
    with pytest.raises(SGLangHTTPError, match="entries"):
        kv_stats_from_kept(prompt_len=4, kept=[4, 5], n_tokens=3)


def test_engine_refuses_a_server_without_the_plugin():
    with FakeSGLang(with_kept=False) as server:
        engine = SGLangRolloutEngine([server.url], KV, timeout_s=10)
        with pytest.raises(SGLangHTTPError, match="does not run the sglang_patches plugin"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))
        dense_engine = SGLangRolloutEngine([server.url], None, timeout_s=10)
        out = dense_engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))[0]
        assert out.kv.kept_kv_tokens == out.kv.dense_kv_tokens == 2 + 3 + 4


def test_update_weights_pauses_pushes_flushes_and_continues(fake):
    sent: list[torch.Tensor] = []
    sync = DistributedWeightSync(bucket_bytes=3 * 4, broadcast=lambda t: sent.append(t.clone()))
    engine = SGLangRolloutEngine([fake.url], KV, weight_sync=sync, timeout_s=10)
    state = {"a": torch.ones(2), "b": torch.zeros(2, 1), "c": torch.arange(3, dtype=torch.float32)}
    engine.update_weights(state)
    assert engine.weight_version == 1
    assert fake.calls[0] == "/pause_generation" and fake.calls[-2:] == ["/flush_cache", "/continue_generation"]
    updates = [r for r in fake.requests if r["path"] == "/update_weights_from_distributed"]
    # 12-byte buckets: a + b = 16 bytes -> split, so three announcements
    assert [u["names"] for u in updates] == [["a"], ["b"], ["c"]]
    assert updates[1]["shapes"] == [[2, 1]] and updates[2]["dtypes"] == ["float32"]
    assert all(u["weight_version"] == "1" and u["flush_cache"] is False for u in updates)
    assert [t.tolist() for t in sent] == [[1.0, 1.0], [[0.0], [0.0]], [0.0, 1.0, 2.0]]
    assert next(r for r in fake.requests if r["path"] == "/pause_generation")["mode"] == "retract"
    outs = engine.generate([[1]], SamplingParams(max_new_tokens=2))
    assert outs[0].weight_version == 1


def test_http_errors_are_raised_with_the_path(fake):
    from slime_sparse.rollout.sglang import SGLangClient

    with pytest.raises(SGLangHTTPError, match="/fail -> HTTP 400"):
        SGLangClient(fake.url, timeout_s=5).post("/fail")
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
    from slime_sparse.config import load_config

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1 2=", "label": "3"}\n')
    argv = ["--hf-checkpoint", str(tmp_path), "--prompt-data", str(data), "--lr", "1e-6",
            "--sglang-num-servers", "2", "--sglang-max-total-tokens", "8192",
            "--sglang-enable-metrics", "--sglang-log-level=warning", "--sglang-gpu-ids", "4,5"]
    cfg = load_config(argv).sglang
    assert cfg.extra_args == ("--max-total-tokens", "8192", "--enable-metrics", "--log-level=warning")
    assert cfg.num_servers == 2 and cfg.router_enabled and cfg.gpu_ids == (4, 5)
    kept, passthrough = split_passthrough(["--lr", "1", "--sglang-x", "--sglang-y", "2"], {"--lr"})
    assert kept == ["--lr", "1"] and passthrough == ["--x", "--y", "2"]
    with pytest.raises(ValueError, match="--sglang-num-servers"):
        SGLangEngineConfig(model_path="/m", num_servers=0).validate()
