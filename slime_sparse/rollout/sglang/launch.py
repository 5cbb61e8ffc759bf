"""Start patched SGLang servers (and a router when there are several) as child processes.

The budgeted cache is switched on per server through the plugin's environment variable
(sglang_patches.settings.ENV_VAR); the flags it requires (page size 1, no radix cache, no overlap scheduler,
no prefill CUDA graph, TP 1) are added here so a server never trips the plugin's start-up checks by default.
The servers die with the process that launched them (Linux: parent-death signal), so a Ray engine actor that is
killed or crashes leaves no server holding its GPU and ports; a replacement waits for the ports to free up.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slime_sparse.kv import KVCompressConfig

from .config import SGLangEngineConfig

KV_ENV_VAR = "SLIME_SPARSE_KV_CONFIG"  # = sglang_patches.settings.ENV_VAR (not imported: it needs no SGLang)


def budgeted_cache_flags(kv: KVCompressConfig | None) -> list[str]:
    """SGLang flags the budgeted cache needs (sglang_patches.preconditions); none when compression is off."""
    if kv is None or not kv.enabled:
        return []
    return ["--page-size", "1", "--disable-radix-cache", "--disable-overlap-schedule",
            "--cuda-graph-backend-prefill", "disabled"]


def server_command(cfg: SGLangEngineConfig, port: int, kv: KVCompressConfig | None) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--host", cfg.host,
        "--port", str(port),
        "--tp-size", "1",
        "--skip-tokenizer-init",  # token ids in, token ids out
        "--load-format", cfg.load_format,
        "--dtype", cfg.dtype,
        "--attention-backend", cfg.attention_backend,
        "--mem-fraction-static", str(cfg.mem_fraction_static),
    ]
    if cfg.max_running_requests is not None:
        cmd += ["--max-running-requests", str(cfg.max_running_requests)]
    if cfg.context_length is not None:
        cmd += ["--context-length", str(cfg.context_length)]
    if not cfg.cuda_graph:
        cmd += ["--disable-decode-cuda-graph", "--disable-prefill-cuda-graph"]
    if cfg.enable_memory_saver:
        cmd += ["--enable-memory-saver"]
    return cmd + budgeted_cache_flags(kv) + list(cfg.extra_args)


def server_env(kv: KVCompressConfig | None, gpu_id: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of one server: its GPU and (when compressing) the plugin's config variable."""
    env = dict(os.environ if base is None else base)
    env["CUDA_VISIBLE_DEVICES"] = str(gpu_id)
    env.pop(KV_ENV_VAR, None)
    if kv is not None and kv.enabled:
        from sglang_patches.settings import encode_config  # checks granularity etc. before any process starts

        env[KV_ENV_VAR] = encode_config(kv)
    return env


def router_command(cfg: SGLangEngineConfig, worker_urls: list[str]) -> list[str]:
    """SGLang's router (package sglang-router) in front of the servers."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", cfg.host,
            "--port", str(cfg.router_port), "--worker-urls", *worker_urls]


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None, poll_s: float = 2.0) -> None:
    """Poll GET {url}/health until it answers 200; raise if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server for {url} exited with code {process.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=poll_s) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def wait_port_free(host: str, port: int, timeout_s: float, poll_s: float = 1.0) -> None:
    """Block until `port` can be bound on `host` (a server of a killed predecessor may still be shutting down)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no obstacle
            try:
                sock.bind((host, port))
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"port {port} on {host} still in use after {timeout_s:.0f} s (another server? "
                                       "see --sglang-base-port / --sglang-router-port)") from None
        time.sleep(poll_s)


def _die_with_parent() -> Callable[[], None] | None:
    """preexec_fn asking Linux to SIGTERM the child when its parent dies (None elsewhere). prctl is looked up here,
    before the fork: the child of a threaded parent should do as little as possible before exec."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return preexec


@dataclass
class ManagedProcess:
    """A child process with its log file; stop() terminates it (and only it). It also dies with this process."""

    name: str
    process: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> "ManagedProcess":
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        log = open(log_path, "w")
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=_die_with_parent())
        log.close()  # the child holds its own handle
        return cls(name, process, log_path)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        # SGLang spawns scheduler/detokenizer children in the same session: signal the whole group we created
        os.killpg(self.process.pid, 15)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait(timeout=timeout_s)


@dataclass
class ServerGroup:
    """Servers (and router) of one engine; `url` is where /generate goes."""

    servers: list[ManagedProcess]
    server_urls: list[str]
    router: ManagedProcess | None
    url: str

    @classmethod
    def launch(cls, cfg: SGLangEngineConfig, kv: KVCompressConfig | None, log_dir: Path) -> "ServerGroup":
        cfg.validate()
        if cfg.attached:
            raise ValueError("--sglang-server-urls names running servers: there is nothing to launch")
        if not cfg.model_path:
            raise ValueError("--hf-checkpoint must name the model the SGLang servers load")
        gpu_ids = cfg.gpu_ids if cfg.gpu_ids is not None else list(range(cfg.num_servers))
        servers, urls = [], []
        router = None
        try:
            for i, gpu in enumerate(gpu_ids):
                port = cfg.base_port + i
                wait_port_free(cfg.host, port, cfg.startup_timeout_s)
                servers.append(ManagedProcess.start(
                    f"sglang-{i}", server_command(cfg, port, kv), server_env(kv, gpu), log_dir))
                urls.append(f"http://{cfg.host}:{port}")
            for proc, url in zip(servers, urls):
                wait_healthy(url, cfg.startup_timeout_s, proc.process)
            url = urls[0]
            if cfg.router_enabled:
                wait_port_free(cfg.host, cfg.router_port, cfg.startup_timeout_s)
                router = ManagedProcess.start("router", router_command(cfg, urls), dict(os.environ), log_dir)
                url = f"http://{cfg.host}:{cfg.router_port}"
                wait_healthy(url, cfg.startup_timeout_s, router.process)
        except BaseException:
            for proc in servers + ([router] if router is not None else []):
                proc.stop()
            raise
        return cls(servers, urls, router, url)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for proc in self.servers:
            proc.stop()
