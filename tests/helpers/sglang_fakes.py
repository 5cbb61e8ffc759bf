"""Fake SGLang servers for CPU tests: the pinned SGLang's HTTP wire format and its weight-sync receiving side.

What the fake does the way SGLang 0.5.15.post1 does it (sglang_patches.contract checks those lines of the source):
- /generate: output_ids, meta_info.output_token_logprobs entries [logprob, token_id, null], finish_reason
  {"type": ...}, meta_info.weight_version (the version of the last update, "default" before any), and the plugin's
  per-token meta_info["sparse_kv_kept"] and ["sparse_kv_evictions"]; tokens are a deterministic function of the prompt and the sampling seed;
- /init_weights_update_group: joins a REAL torch.distributed group as SGLang's init_custom_process_group does
  (rendezvous at tcp://master_address:master_port, PrefixStore(group_name), torch's _new_process_group_helper),
  returning once the whole group is formed;
- /update_weights_from_distributed with load_format "flattened_bucket": receives one broadcast from rank 0 into the
  buffer FlattenedTensorBucket builds (the tensors' bytes back to back) and rebuilds the named tensors from it;
- /update_weights_from_tensor: base64 pickles read through an allow-list unpickler like SGLang's SafeUnpickler;
- /flush_cache answers plain text, or HTTP 400 while `flush_refusals` > 0 (SGLang's answer while requests remain).
Every call is recorded; GET /fake/state returns the record and the weights received (raw bytes, base64).

Run it in a thread of the test (FakeSGLang) or as its own process (fake_server_processes), as many as a test
needs: torch registers group names per process, so only one member of a group may live in one process.
"""
from __future__ import annotations

import base64
import contextlib
import io
import json
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from sglang_patches.evictions import append_at, eviction_entry

GROUP_TIMEOUT_S = 60.0


def fake_generation(input_ids: list[int], sp: dict, with_kept: bool, weight_version: str = "default") -> dict:
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
        "weight_version": weight_version,
    }
    if with_kept and n > 1:
        kept, cache, events = [len(input_ids)], len(input_ids), []
        for i in range(1, n):
            if cache >= 8:  # the plugin's event: 2 sink slots and the 4 most recent stay, before token i
                start = len(input_ids) + i - 1
                append_at(events, i, eviction_entry(start, cache, torch.tensor([0, 1, *range(cache - 4, cache)])))
                cache = 6
            cache += 1
            kept.append(cache)
        meta["sparse_kv_kept"] = kept
        if events:
            meta["sparse_kv_evictions"] = events
    return {"output_ids": out, "meta_info": meta}


def join_like_sglang(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                     backend: str) -> dist.ProcessGroup:
    """sglang.srt.utils.common.init_custom_process_group, as ModelRunner.init_weights_update_group calls it."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def receive_flattened_bucket(group: dist.ProcessGroup, names: list[str], dtypes: list[str],
                             shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    """ModelRunner._update_bucketed_weights_from_distributed: empty tensors of the announced dtypes and shapes,
    flattened to bytes and concatenated (FlattenedTensorBucket), one broadcast from rank 0, tensors cut back out."""
    empties = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes)]
    flat = torch.cat([t.flatten().view(torch.uint8) for t in empties])
    dist.broadcast(flat, src=0, group=group)
    out, start = {}, 0
    for name, t in zip(names, empties):
        end = start + t.numel() * t.element_size()
        out[name] = flat[start:end].view(t.dtype).reshape(t.shape).clone()
        start = end
    return out


class AllowListUnpickler(pickle.Unpickler):
    """The part of SGLang's SafeUnpickler allow-list that tensors need: anything else is refused."""

    PREFIXES = ("torch.", "collections.", "builtins.")

    def find_class(self, module: str, name: str) -> Any:
        if not (module + ".").startswith(self.PREFIXES):
            raise pickle.UnpicklingError(f"blocked {module}.{name}")
        return super().find_class(module, name)


def encode_tensor(t: torch.Tensor) -> dict:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(raw).decode()}


def decode_tensor(obj: dict) -> torch.Tensor:
    raw = bytearray(base64.b64decode(obj["data"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, obj["dtype"])).reshape(obj["shape"])


class FakeSGLang:
    """One fake server on 127.0.0.1 (a port of the OS's choosing), serving from a thread until __exit__."""

    def __init__(self, with_kept: bool = True):
        self.with_kept = with_kept
        self.calls: list[str] = []
        self.requests: list[dict] = []
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.joined: list[dict] = []  # /init_weights_update_group payloads that formed a group
        self.weights: dict[str, torch.Tensor] = {}
        self.weight_version = "default"
        self.flush_refusals = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _reply(self, obj, code=200):
                body = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(obj, str) else "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/fake/state":
                    self._reply(fake.state())
                    return
                fake.record(self.path, {})
                self._reply({})

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                payload = json.loads(self.rfile.read(length) or b"{}")
                try:
                    self._reply(*fake.handle(self.path, payload))
                except Exception as exc:  # noqa: BLE001 - SGLang answers failures with success=false
                    self._reply({"success": False, "message": f"{type(exc).__name__}: {exc}"}, 400)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def record(self, path: str, payload: dict) -> None:
        with self.lock:
            self.calls.append(path)
            # tensor payloads are large and checked through `weights`
            kept = {k: v for k, v in payload.items() if k != "serialized_named_tensors"}
            self.requests.append({"path": path, **kept})

    def handle(self, path: str, payload: dict) -> tuple[Any, int]:
        self.record(path, payload)
        if path == "/generate":
            return fake_generation(payload["input_ids"], payload["sampling_params"], self.with_kept,
                                   self.weight_version), 200
        if path == "/flush_cache":
            with self.lock:
                if self.flush_refusals > 0:
                    self.flush_refusals -= 1
                    return "Cache not flushed: pending requests\n", 400
            return "Cache flushed.\n", 200
        if path == "/init_weights_update_group":
            group = join_like_sglang(payload["master_address"], payload["master_port"], payload["rank_offset"],
                                     payload["world_size"], payload["group_name"], payload["backend"])
            with self.lock:
                self.groups[payload["group_name"]] = group
                self.joined.append(payload)
            return {"success": True, "message": "Succeeded to initialize custom process group."}, 200
        if path == "/destroy_weights_update_group":
            found = self.groups.pop(payload["group_name"], None) is not None
            return {"success": found, "message": "destroyed" if found else "no such group"}, 200 if found else 400
        if path == "/update_weights_from_distributed":
            if payload.get("load_format") != "flattened_bucket":
                raise ValueError(f"this fake receives flattened buckets only, got {payload.get('load_format')!r}")
            got = receive_flattened_bucket(self.groups[payload["group_name"]], payload["names"], payload["dtypes"],
                                           payload["shapes"])
            return self._loaded(got, payload), 200
        if path == "/update_weights_from_tensor":
            (serialized,) = payload["serialized_named_tensors"]  # TP 1: one payload
            named = AllowListUnpickler(io.BytesIO(base64.b64decode(serialized))).load()
            return self._loaded(dict(named), payload), 200
        if path == "/fake/config":
            self.flush_refusals = int(payload.get("flush_refusals", 0))
            return {"status": "ok"}, 200
        return {"status": "ok"}, 200

    def _loaded(self, tensors: dict[str, torch.Tensor], payload: dict) -> dict:
        with self.lock:
            self.weights.update(tensors)
            if payload.get("weight_version") is not None:
                self.weight_version = payload["weight_version"]
        return {"success": True, "message": "Succeeded to update parameter online."}

    def state(self) -> dict:
        with self.lock:
            return {"calls": list(self.calls), "requests": list(self.requests), "joined": list(self.joined),
                    "weight_version": self.weight_version,
                    "weights": {n: encode_tensor(t) for n, t in self.weights.items()}}


@dataclass
class FakeState:
    """GET /fake/state, decoded."""

    calls: list[str]
    requests: list[dict]
    joined: list[dict]
    weight_version: str
    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, raw: dict) -> "FakeState":
        return cls(raw["calls"], raw["requests"], raw["joined"], raw["weight_version"],
                   {n: decode_tensor(t) for n, t in raw["weights"].items()})

    def requests_to(self, path: str) -> list[dict]:
        return [r for r in self.requests if r["path"] == path]


def fetch_state(url: str) -> FakeState:
    import urllib.request

    with urllib.request.urlopen(f"{url}/fake/state", timeout=30) as resp:
        return FakeState.of(json.loads(resp.read()))


@contextlib.contextmanager
def fake_server_processes(n: int, timeout_s: float = 120.0) -> Iterator[list[str]]:
    """`n` fake servers, each its own process (as real servers are); yields their URLs, stops them after."""
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]
    try:
        urls = []
        for proc in procs:
            line = _readline(proc, timeout_s)
            if not line.startswith("URL "):
                raise RuntimeError(f"fake SGLang server did not start (exit code {proc.poll()}): {line!r}")
            urls.append(line.split()[1])
        yield urls
    finally:
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # the server exits when its stdin closes
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0].strip() if box else ""


def main() -> None:
    torch.set_num_threads(1)
    with FakeSGLang() as fake:
        print("URL", fake.url, flush=True)
        sys.stdin.read()  # until the test closes our stdin (or dies)


if __name__ == "__main__":
    main()
