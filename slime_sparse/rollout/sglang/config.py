"""Settings of the SGLang rollout engine and the flags that carry them.

Two kinds of flags, as in slime:
- ours (`--sglang-num-servers`, `--sglang-base-port`, ...), parsed into SGLangEngineConfig;
- any other `--sglang-<name> [value]` is passed through to every server as `--<name> [value]`.
The KV-compression settings come from the shared `--kv-*` flags (slime_sparse.kv.KVCompressConfig).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class SGLangEngineConfig:
    model_path: str  # HF directory (or name) every server loads
    num_servers: int = 1  # one server per GPU (TP 1 is a precondition of the budgeted cache)
    host: str = "127.0.0.1"
    base_port: int = 30000  # server i listens on base_port + i; the router on router_port
    router_port: int = 30100
    use_router: bool | None = None  # None = a router exactly when num_servers > 1
    gpu_ids: list[int] | None = None  # None = 0 .. num_servers - 1
    attention_backend: str = "fa3"
    mem_fraction_static: float = 0.7
    cuda_graph: bool = True  # decode CUDA graphs (prefill graphs are always off under compression)
    load_format: str = "auto"  # "dummy" = random weights (smoke tests)
    dtype: str = "auto"
    max_running_requests: int | None = None
    context_length: int | None = None
    enable_memory_saver: bool = False  # colocated trainer: release/resume KV cache and weights
    extra_args: list[str] = field(default_factory=list)  # pass-through server flags
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0
    max_concurrency: int = 256  # in-flight /generate requests from this client

    def validate(self) -> None:
        if not self.model_path:
            raise ValueError("--hf-checkpoint / model_path must name the model the servers load")
        if self.num_servers < 1:
            raise ValueError(f"--sglang-num-servers={self.num_servers} must be >= 1")
        if self.gpu_ids is not None and len(self.gpu_ids) != self.num_servers:
            raise ValueError(f"--sglang-gpu-ids lists {len(self.gpu_ids)} GPUs for {self.num_servers} servers")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--sglang-mem-fraction-static={self.mem_fraction_static} must lie in (0, 1)")
        if self.max_concurrency < 1:
            raise ValueError(f"--sglang-max-concurrency={self.max_concurrency} must be >= 1")
        for port_name, port in (("--sglang-base-port", self.base_port), ("--sglang-router-port", self.router_port)):
            if not 1 <= port <= 65535:
                raise ValueError(f"{port_name}={port} is not a TCP port")

    @property
    def router_enabled(self) -> bool:
        return self.num_servers > 1 if self.use_router is None else self.use_router


def add_sglang_arguments(parser: argparse.ArgumentParser) -> None:
    """Our --sglang-* flags (everything else starting with --sglang- is passed to the servers)."""
    g = parser.add_argument_group("SGLang rollout engine")
    g.add_argument("--sglang-num-servers", type=int, default=1)
    g.add_argument("--sglang-base-port", type=int, default=30000)
    g.add_argument("--sglang-router-port", type=int, default=30100)
    g.add_argument("--sglang-gpu-ids", type=int, nargs="+", default=None)
    g.add_argument("--sglang-attention-backend", default="fa3")
    g.add_argument("--sglang-mem-fraction-static", type=float, default=0.7)
    g.add_argument("--sglang-disable-cuda-graph", action="store_true")
    g.add_argument("--sglang-load-format", default="auto")
    g.add_argument("--sglang-dtype", default="auto")
    g.add_argument("--sglang-max-concurrency", type=int, default=256)
    g.add_argument("--sglang-enable-memory-saver", action="store_true")


def split_passthrough(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(argv without the pass-through flags, server flags): `--sglang-foo v` -> `--foo v` unless ours.

    A pass-through flag takes the following token as its value unless that token starts with "--".
    """
    ours = {opt for action in parser._actions for opt in action.option_strings}
    kept, server = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name.startswith("--sglang-") and name not in ours:
            server.append("--" + token[len("--sglang-"):])
            if "=" not in token and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                server.append(argv[i + 1])
                i += 1
        else:
            kept.append(token)
        i += 1
    return kept, server


def config_from_args(args: argparse.Namespace, model_path: str, passthrough: list[str]) -> SGLangEngineConfig:
    cfg = SGLangEngineConfig(
        model_path=model_path,
        num_servers=args.sglang_num_servers,
        base_port=args.sglang_base_port,
        router_port=args.sglang_router_port,
        gpu_ids=args.sglang_gpu_ids,
        attention_backend=args.sglang_attention_backend,
        mem_fraction_static=args.sglang_mem_fraction_static,
        cuda_graph=not args.sglang_disable_cuda_graph,
        load_format=args.sglang_load_format,
        dtype=args.sglang_dtype,
        max_concurrency=args.sglang_max_concurrency,
        enable_memory_saver=args.sglang_enable_memory_saver,
        extra_args=list(passthrough),
    )
    cfg.validate()
    return cfg
