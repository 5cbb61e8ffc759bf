"""Settings of the SGLang rollout engine and the flags that carry them.

Two kinds of flags, as in slime:
- ours (`--sglang-num-servers`, `--sglang-base-port`, ...): the fields of SGLangEngineConfig, the `sglang`
  section of the run config (slime_sparse.config);
- any other `--sglang-<name> [value]` is passed through to every server as `--<name> [value]`.
The KV-compression settings come from the shared `--kv-*` flags (slime_sparse.kv.KVCompressConfig).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SGLangEngineConfig:
    model_path: str = ""  # HF directory every server loads; filled from --hf-checkpoint by the training loop
    # with --use-ray each engine runs --rollout-num-gpus-per-engine servers instead, on the GPUs of its
    # placement-group bundles
    num_servers: int = field(default=1, metadata={"help": (
        "SGLang servers started, one per GPU (TP 1 is a precondition of the budgeted cache)")})
    host: str = field(default="127.0.0.1", metadata={"help": "address the servers and the router listen on"})
    # with --use-ray, engine e shifts the ports by e x its server count and by e, so the engines of one node never
    # collide
    base_port: int = field(default=30000, metadata={"help": "server i listens on base port + i"})
    router_port: int = field(default=30100, metadata={"help": "port of the router in front of the servers"})
    use_router: bool | None = field(default=None, metadata={"help": (
        "put a router in front of the servers; unset: exactly when there are several")})
    gpu_ids: tuple[int, ...] | None = field(default=None, metadata={"help": (
        "GPU of each server; unset: 0 .. --sglang-num-servers - 1")})
    attention_backend: str = field(default="fa3", metadata={"help": (
        "SGLang's attention backend (slime: SGLang's own choice); fa3 here, one of the four our KV eviction "
        "supports (fa3, flashinfer, triton, torch_native)")})
    mem_fraction_static: float = field(default=0.7, metadata={"help": (
        "SGLang's static memory fraction (slime: SGLang's default); 0.7 here, as slime's scripts pass")})
    cuda_graph: bool = field(default=True, metadata={"help": (
        "decode CUDA graphs (prefill graphs are always off under compression)")})
    load_format: str = field(default="auto", metadata={"help": (
        "SGLang's --load-format; dummy: random weights (smoke tests)")})
    dtype: str = field(default="auto", metadata={"help": "SGLang's --dtype"})
    max_running_requests: int | None = field(default=None, metadata={"help": (
        "SGLang's --max-running-requests; unset: SGLang's choice")})
    context_length: int | None = field(default=None, metadata={"help": "SGLang's --context-length; unset: the model's"})
    enable_memory_saver: bool = field(default=False, metadata={"help": (
        "release and resume the KV cache and weights around training (colocated learner)")})
    extra_args: tuple[str, ...] = ()  # pass-through server flags (every unknown --sglang-X becomes --X)
    # Servers started by hand or by a cluster scheduler need the plugin installed and SLIME_SPARSE_KV_CONFIG set.
    # With --use-ray the list is cut into --rollout-num-gpus-per-engine consecutive URLs per engine.
    server_urls: tuple[str, ...] = field(default=(), metadata={"help": (
        "attach to these running servers instead of launching them; requests are spread over them")})
    startup_timeout_s: float = field(default=600.0, metadata={"help": "seconds a launched server may take to come up"})
    request_timeout_s: float = field(default=3600.0, metadata={"help": "seconds one /generate request may take"})
    max_concurrency: int = field(default=256, metadata={"help": "in-flight /generate requests from this client"})

    def validate(self) -> None:
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
        bad = [u for u in self.server_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"--sglang-server-urls: {bad} are not http(s)://host:port URLs")
        if len(set(self.server_urls)) != len(self.server_urls):
            raise ValueError(f"--sglang-server-urls lists a server twice: {list(self.server_urls)}")

    @property
    def attached(self) -> bool:
        """The servers run already (--sglang-server-urls): nothing is launched."""
        return bool(self.server_urls)

    @property
    def router_enabled(self) -> bool:
        return self.num_servers > 1 if self.use_router is None else self.use_router


def sglang_lm_head_args(fp32: bool) -> tuple[str, ...]:
    """Server flags that give SGLang's logits the learner's head arithmetic (`slime_sparse.utils.lm_head`): its
    LogitsProcessor runs the head GEMM on fp32 operands with --enable-fp32-lm-head, in the model dtype otherwise,
    and its sampler records log(softmax(logits / T)) in fp32 before top-k / top-p either way."""
    return ("--enable-fp32-lm-head",) if fp32 else ()


def split_passthrough(argv: list[str], ours: set[str]) -> tuple[list[str], list[str]]:
    """(argv without the pass-through flags, server flags): `--sglang-foo v` -> `--foo v` unless ours.

    A pass-through flag takes the following token as its value unless that token starts with "--".
    """
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
