"""How the KV-compression settings reach SGLang's scheduler processes: one JSON environment variable.

SGLang's ServerArgs rejects unknown flags, and its scheduler processes are spawned from the launching process,
inheriting its environment. So the launcher (slime_sparse.rollout.sglang) serialises a KVCompressConfig into
`SLIME_SPARSE_KV_CONFIG`, and the plugin reads it back in every process. Unset (or method "none") = the plugin
registers no hook and SGLang runs unpatched. A single request can still ask to stay dense (DENSE_REQUEST_PARAM).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from slime_sparse.kv import KVCompressConfig

ENV_VAR = "SLIME_SPARSE_KV_CONFIG"
# Per-request opt-out, in /generate's sampling_params.custom_params (SGLang hands that dict to the scheduler as
# Req.sampling_params.custom_params): {DENSE_REQUEST_PARAM: true} keeps the request's whole cache, so a compressing
# server can also serve dense evaluation. Other KV configs cannot change per request: the query rings and the
# trigger are sized by the start-up config.
DENSE_REQUEST_PARAM = "slime_sparse_dense"

# Why only "model": SGLang's req_to_token row maps each logical token of a request to ONE slot index that every
# layer's K/V buffer and every head use (the attention kernels read one page table per request). Compacting that
# row can only express one kept set per request, shared by all layers and heads; per-layer or per-head selection
# would need per-layer page tables, i.e. attention-kernel changes.
REQUIRED_GRANULARITY = "model"


# One budget for every layer follows: --kv-granularity model needs one (KVCompressConfig.validate), and SGLang could
# not hold several anyway, a request's slots being shared by every layer (sglang_patches/README.md, "Per-layer
# budgets").


def check_sglang_kv_config(cfg: KVCompressConfig) -> None:
    """Raise ValueError (naming the flag) unless cfg is valid and expressible by req_to_token compaction: the one
    place of SGLang's rules. Called at start-up (slime_sparse.startup), by the SGLang engine, and by
    encode_config / decode_config, before a server starts and in every server process."""
    cfg.validate(prefix="--kv-")
    if cfg.enabled and cfg.granularity != REQUIRED_GRANULARITY:
        raise ValueError(
            f"--kv-granularity={cfg.granularity!r} is not supported by the SGLang engine: SGLang keeps one "
            f"req_to_token row per request shared by every layer and head, so selection must be "
            f"--kv-granularity={REQUIRED_GRANULARITY}"
        )



def encode_config(cfg: KVCompressConfig) -> str:
    """JSON text of cfg for ENV_VAR (checked first, so a bad config fails in the launcher, not in a server)."""
    check_sglang_kv_config(cfg)
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def decode_config(text: str) -> KVCompressConfig:
    """Inverse of encode_config; unknown keys are an error (a launcher/plugin version mismatch)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV_VAR} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{ENV_VAR} must hold a JSON object, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(KVCompressConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{ENV_VAR} has unknown KVCompressConfig fields {unknown}")
    cfg = KVCompressConfig(**raw)
    check_sglang_kv_config(cfg)
    return cfg


def config_from_environ(environ: Mapping[str, str] | None = None) -> KVCompressConfig | None:
    """The active config, or None when compression is off (variable unset, empty, or method "none")."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    cfg = decode_config(text)
    return cfg if cfg.enabled else None
