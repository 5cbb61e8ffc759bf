"""SGLang rollout engine: patched SGLang servers (sglang_patches plugin) behind the RolloutEngine protocol.

Importing this package needs neither SGLang nor Ray: servers are child processes (or already running, attached by
URL) spoken to over HTTP. `worker.SGLangEngineWorker` is the engine as a Ray actor of RayRolloutGroup.
"""
from .client import SGLangClient, SGLangHTTPError, kv_stats_from_kept, parse_generate_response, sampling_payload
from .config import SGLangEngineConfig, split_passthrough
from .engine import (
    DistributedWeightSync,
    SGLangRolloutEngine,
    TensorWeightSync,
    load_from_distributed,
    serialize_named_tensors,
)
from .launch import ServerGroup, budgeted_cache_flags, server_command, server_env

__all__ = [
    "DistributedWeightSync",
    "SGLangClient",
    "SGLangEngineConfig",
    "SGLangHTTPError",
    "SGLangRolloutEngine",
    "ServerGroup",
    "TensorWeightSync",
    "budgeted_cache_flags",
    "kv_stats_from_kept",
    "load_from_distributed",
    "parse_generate_response",
    "sampling_payload",
    "serialize_named_tensors",
    "server_command",
    "server_env",
    "split_passthrough",
]
