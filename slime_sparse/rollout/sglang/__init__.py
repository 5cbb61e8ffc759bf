"""SGLang rollout engine: patched SGLang servers (sglang_patches plugin) behind the RolloutEngine protocol.

Importing this package needs neither SGLang nor Ray: servers are child processes spoken to over HTTP, Ray is
imported by `actor` only when an actor is built.
"""
from .client import SGLangClient, SGLangHTTPError, kv_stats_from_kept, parse_generate_response, sampling_payload
from .config import SGLangEngineConfig, split_passthrough
from .engine import DistributedWeightSync, SGLangRolloutEngine, TensorWeightSync
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
    "parse_generate_response",
    "sampling_payload",
    "server_command",
    "server_env",
    "split_passthrough",
]
