"""HTTP client for one SGLang endpoint (a server or the router), and the pure translation of its responses.

Wire format, read from the pinned SGLang (checked by sglang_patches.contract):
- POST /generate {"input_ids": [...], "sampling_params": {...}, "return_logprob": true} with
  --skip-tokenizer-init answers {"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop"|"length"|
  "abort", ...}, "output_token_logprobs": [[logprob, token_id, null], ...], "weight_version": ..., ...}};
- with the budgeted cache, meta_info["sparse_kv_kept"][i] is the number of KV slots attention read to produce
  output token i (sglang_patches.runtime.KEPT_INFO_KEY), and meta_info["sparse_kv_evictions"] the request's
  compressions (sglang_patches.evictions), decoded into the sample's EvictionRecord;
- control endpoints answer JSON ({"success": ..., "message": ...} for weight updates), except /flush_cache, which
  answers plain text with 200, or 400 while requests are still queued or running.
HTTP goes through the standard library only, so this runs (and is tested) anywhere.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from sglang_patches.evictions import EVICTIONS_INFO_KEY, NotRecordable, decode_evictions
from sglang_patches.settings import DENSE_REQUEST_PARAM
from slime_sparse.kv.record import EvictionRecord
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.types import GenerationOutput, KVStats

KEPT_KEY = "sparse_kv_kept"  # = sglang_patches.runtime.KEPT_INFO_KEY
FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for one flat uint8 buffer per broadcast bucket

logger = logging.getLogger(__name__)


class SGLangHTTPError(RuntimeError):
    """A non-2xx answer, or an answer SGLang would never send."""


class SGLangClient:
    def __init__(self, base_url: str, timeout_s: float = 3600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _request(self, method: str, path: str, payload: dict | None = None, *, as_json: bool = True) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            raise SGLangHTTPError(f"{method} {path} -> HTTP {exc.code}: {exc.read()[:500]!r}") from exc
        if not as_json:
            return body.decode(errors="replace")
        return json.loads(body) if body else None

    def post(self, path: str, payload: dict | None = None) -> Any:
        return self._request("POST", path, payload if payload is not None else {})

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, input_ids: list[int], sampling_params: dict) -> dict:
        out = self.post("/generate", {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True})
        if not isinstance(out, dict):
            raise SGLangHTTPError(f"/generate returned {type(out).__name__} for one prompt, expected an object")
        return out

    # -- control ----------------------------------------------------------------------------------------------
    def health(self) -> bool:
        try:
            self._request("GET", "/health")
            return True
        except (SGLangHTTPError, urllib.error.URLError, ConnectionError):
            return False

    def flush_cache(self, attempts: int = 20, wait_s: float = 0.5) -> None:
        """Drop the KV cache (and the plugin's query rings). SGLang refuses while requests are queued or running
        (HTTP 400), e.g. requests of a client that just went away and are being aborted: retry a while."""
        for attempt in range(attempts):
            try:
                self._request("POST", "/flush_cache", {}, as_json=False)
                return
            except SGLangHTTPError:
                if attempt == attempts - 1:
                    raise
                time.sleep(wait_s)

    def pause_generation(self, mode: str = "retract") -> None:
        """mode "retract": running requests go back to the queue and are re-prefilled after continue."""
        self.post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.post("/continue_generation")

    def release_memory_occupation(self) -> None:
        self.post("/release_memory_occupation")

    def resume_memory_occupation(self) -> None:
        self.post("/resume_memory_occupation")

    # -- weights ----------------------------------------------------------------------------------------------
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl") -> None:
        self._check_success("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        })

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._check_success("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, weight_version: str,
                                        load_format: str | None = FLATTENED_BUCKET) -> None:
        """Receive one broadcast bucket from rank 0 of `group_name`; returns once it is loaded."""
        self._check_success("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": False, "weight_version": weight_version,  # we flush once, after the last bucket
            "load_format": load_format,
        })

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], weight_version: str,
                                   load_format: str | None = None) -> None:
        self._check_success("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
            "flush_cache": False, "weight_version": weight_version,
        })

    def _check_success(self, path: str, payload: dict) -> None:
        out = self.post(path, payload)
        if not (isinstance(out, dict) and out.get("success", False)):
            raise SGLangHTTPError(f"POST {path} failed: {out!r}")


def dense_request_params() -> dict:
    """custom_params that make a request skip the budgeted cache's compression (sglang_patches reads them)."""
    return {DENSE_REQUEST_PARAM: True}


# ----------------------------------------------------------------------------------------------------------------
# Pure translation
# ----------------------------------------------------------------------------------------------------------------
def sampling_payload(params: SamplingParams, seed: int | None, custom_params: dict | None = None) -> dict:
    """SGLang sampling_params for one request (`custom_params`: per-request fields our plugin reads).

    SGLang seeds a request only on its plain multinomial path (no top-k/top-p truncation); there the seed plus the
    token's logical position fixes the draw. With truncation the draw is not reproducible, so no seed is sent.
    """
    params.validate()
    payload: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token in output_ids: the learner trains on it
    }
    if params.stop_token_ids:
        payload["stop_token_ids"] = list(params.stop_token_ids)
    truncated = params.top_p < 1.0 or params.top_k > 0
    if seed is not None and not truncated and not params.greedy:
        payload["sampling_seed"] = seed
    if custom_params:
        payload["custom_params"] = dict(custom_params)
    return payload


def kv_stats_from_kept(prompt_len: int, kept: list[int] | None, n_tokens: int) -> KVStats:
    """KVStats of one sequence from the per-token cache sizes the plugin reports (None = dense server).

    dense: the token i of the response is produced with prompt_len + i cached tokens; kept: what the budgeted
    cache held then. A drop from one token to the next is a compression.
    """
    dense = [prompt_len + i for i in range(n_tokens)]
    held = dense if kept is None else [int(x) for x in kept[:n_tokens]]
    if len(held) != n_tokens:
        raise SGLangHTTPError(f"meta_info[{KEPT_KEY!r}] has {len(held)} entries for {n_tokens} output tokens")
    compressions = sum(1 for a, b in zip(held, held[1:]) if b < a)
    return KVStats(dense_kv_tokens=sum(dense), kept_kv_tokens=sum(held), peak_kv_tokens=max(held, default=0),
                   compressions=compressions)


def parse_generate_response(
    prompt_ids: list[int], response: dict, expect_kept: bool, weight_version: int
) -> GenerationOutput:
    """GenerationOutput from one /generate answer; expect_kept = the server runs the budgeted cache."""
    meta = response.get("meta_info")
    if not isinstance(meta, dict) or "output_ids" not in response:
        raise SGLangHTTPError(f"/generate answer lacks output_ids/meta_info: {str(response)[:300]}")
    output_ids = [int(t) for t in response["output_ids"]]
    logprob_entries = meta.get("output_token_logprobs")
    if logprob_entries is None:
        raise SGLangHTTPError("/generate answer has no output_token_logprobs (was return_logprob sent?)")
    if len(logprob_entries) != len(output_ids):
        raise SGLangHTTPError(f"{len(logprob_entries)} log-probs for {len(output_ids)} output tokens")
    for (_, token_id, *_), token in zip(logprob_entries, output_ids):
        if int(token_id) != token:
            raise SGLangHTTPError(f"log-prob entry for token {token_id} where output_ids has {token}")
    finish = (meta.get("finish_reason") or {}).get("type")
    if finish not in ("stop", "length"):
        raise SGLangHTTPError(f"request finished with {meta.get('finish_reason')!r}")
    served = meta.get("weight_version")
    if weight_version > 0 and served is not None and str(served) != str(weight_version):
        # SGLang reports the version of its last update: a server that missed a sync must not feed the learner
        raise SGLangHTTPError(f"the server generated with weight version {served!r}, the engine holds {weight_version}")
    kept = meta.get(KEPT_KEY)
    if expect_kept and kept is None and len(output_ids) > 1:
        raise SGLangHTTPError(
            f"meta_info has no {KEPT_KEY!r}: the server does not run the sglang_patches plugin "
            "(install slime_sparse on the server node and check its log for 'slime_sparse budgeted KV cache')"
        )
    kv = kv_stats_from_kept(len(prompt_ids), kept, len(output_ids))
    evictions = evictions_from_meta(meta, len(prompt_ids) + len(output_ids))
    if evictions is not None:  # exact, where the cache sizes miss a cut that ends at the same size
        kv = dataclasses.replace(kv, compressions=int(evictions.starts.numel()))
    return GenerationOutput(
        prompt_ids=list(prompt_ids),
        response_ids=output_ids,
        logprobs=[float(entry[0]) for entry in logprob_entries],
        finish_reason=finish,
        kv=kv,
        weight_version=weight_version,
        evictions=evictions,
    )


def evictions_from_meta(meta: dict, length: int) -> EvictionRecord | None:
    """The sample's eviction record from meta_info (None: it never compressed, or it cannot have one).

    A request retracted after a compression has no record (a warning names it): a shadow loss then refuses the
    sample (pipeline.prepare_rollout: compressions without a record), a sparse_rl run does not need it. Entries
    the plugin cannot have sent are an error naming the request.
    """
    entries = meta.get(EVICTIONS_INFO_KEY)
    if not entries:
        return None
    rid = meta.get("id")
    try:
        record = decode_evictions(entries)
    except NotRecordable as exc:
        logger.warning("request %s: no eviction record: %s", rid, exc)
        return None
    except ValueError as exc:
        raise SGLangHTTPError(f"request {rid}: meta_info[{EVICTIONS_INFO_KEY!r}]: {exc}") from exc
    if record is not None and int(record.starts[-1]) >= length:  # the last compression precedes a decode step
        raise SGLangHTTPError(f"request {rid}: a compression after {int(record.starts[-1])} tokens of a {length}-token "
                              "sequence")
    return record
