"""How many more KV slots a request can still need under the budget: the numbers SGLang's admission control uses.

SGLang's scheduler admits a new request only if the free pool covers, for every request, what it may still write
(`PrefillAdder`: running requests reserve min(max_new_tokens - generated, CLIP) * new_token_ratio, a new one its
prompt plus min(max_new_tokens, CLIP)). That is right for a dense cache, but under our plugin a compressed request
never holds more than max(its prefilled length, budget + buffer) slots: the cache is compacted back to B whenever
it reaches B + buffer (slime_sparse.kv.schedule, asked at every ScheduleBatch.prepare_for_decode). So what it
can still need is bounded by that peak minus what it holds now, however many tokens it may still generate.

Slot bookkeeping of one request in SGLang (page_size 1), which the functions below follow exactly:
- the prefill writes the prompt_len + generated tokens (generated > 0 only for a retracted request re-prefilled
  from its tokens) and samples one output token;
- each decode step writes ONE slot, for the newest output token (sampled but not yet cached), after our hook
  compacted the cache if it reached the trigger; it then samples the next token;
- the last output token is never written, so with n tokens generated and the prefill done the cache holds
  prompt_len + n - 1 slots densely, and max_new_tokens - n writes remain (SGLang's own count for running requests).

Everything here is integer arithmetic over slime_sparse.kv.schedule's rule; hooks.py reads the request fields and
applies the results.
"""
from __future__ import annotations

from typing import Any

from slime_sparse.kv import KVCompressConfig, peak_slots, should_compress, slots_after_compression


def _check_non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")


def remaining_slot_need(
    prompt_len: int,
    generated: int,
    cache_len: int,
    max_new_tokens: int,
    cfg: KVCompressConfig,
    dense: bool = False,
) -> int:
    """Most KV slots the request will hold above `cache_len` from now to its end (0 if it never grows).

    prompt_len: tokens of the original prompt; generated: output tokens so far (len(Req.output_ids));
    cache_len: slots the request holds now (Req.kv_committed_len); 0 means its (re)prefill of
    prompt_len + generated tokens is still to come. dense: the request opted out of compression (or cfg is off).

    Equals min(dense remaining need, budget bound): the dense need is every slot still to be written; the budget
    bound is the peak the trigger allows. Both assume the request runs to max_new_tokens (an early stop only
    lowers the truth), so the value is an upper bound SGLang may safely reserve.
    """
    _check_non_negative(prompt_len=prompt_len, generated=generated, cache_len=cache_len,
                        max_new_tokens=max_new_tokens)
    if cache_len == 0:
        # The prefill comes first: it holds every prefilled slot at once, then decoding starts from there.
        prefilled = prompt_len + generated
        if prefilled == 0:
            raise ValueError("prompt_len + generated must be >= 1 for a request still to be prefilled")
        return prefilled + _decode_growth(generated + 1, prefilled, max_new_tokens, cfg, dense)
    if generated == 0:
        # A cache without an output token is a prefill in progress (chunked): not a state admission asks about.
        raise ValueError(f"generated=0 with cache_len={cache_len}: a request holding slots has generated >= 1")
    return _decode_growth(generated, cache_len, max_new_tokens, cfg, dense)


def _decode_growth(generated: int, cache_len: int, max_new_tokens: int, cfg: KVCompressConfig, dense: bool) -> int:
    """Peak growth over the remaining decode steps, from a prefilled cache of cache_len slots."""
    steps = max(0, max_new_tokens - generated)  # one slot written per remaining decode step
    if dense:
        return steps
    return peak_slots(cache_len, steps, cfg, first_decode=generated == 1) - cache_len


def decode_reservation_after_prefill(
    prompt_len: int, generated: int, max_new_tokens: int, cfg: KVCompressConfig, dense: bool = False
) -> int:
    """Slots a request about to be (re)prefilled can need beyond its prefilled tokens.

    This is what replaces SGLang's min(max_new_tokens, CLIP) in a new request's reservation (the prefilled
    tokens themselves are reserved separately, as extend_input_len).
    """
    prefilled = prompt_len + generated
    return remaining_slot_need(prompt_len, generated, 0, max_new_tokens, cfg, dense) - prefilled


def slots_freed_by_next_compaction(cache_len: int, generated: int, cfg: KVCompressConfig, dense: bool = False) -> int:
    """Slots our prepare_for_decode hook frees before SGLang allocates the next decode slot (0 if no trigger).

    Compaction keeps exactly min(cache_len, budget) slots (slime_sparse.kv.schedule.slots_after_compression).
    """
    _check_non_negative(cache_len=cache_len, generated=generated)
    if dense or not should_compress(cache_len, cfg, first_decode=generated == 1):
        return 0
    return cache_len - slots_after_compression(cache_len, cfg.budget)  # one budget: sglang_patches.settings


# ----------------------------------------------------------------------------------------------------------------
# The same numbers read from SGLang's Req (fields guarded by sglang_patches.contract)
# ----------------------------------------------------------------------------------------------------------------
def running_request_need(req: Any, cfg: KVCompressConfig, dense: bool) -> int | None:
    """remaining_slot_need of a request in the running batch, or None when it holds no prefilled cache yet."""
    generated = len(req.output_ids)
    if generated == 0 or req.kv_committed_len == 0:
        return None
    return remaining_slot_need(len(req.origin_input_ids), generated, req.kv_committed_len,
                               req.sampling_params.max_new_tokens, cfg, dense)


def new_request_decode_reservation(req: Any, cfg: KVCompressConfig, dense: bool) -> int:
    """decode_reservation_after_prefill of a waiting request (fresh, or retracted with its tokens so far)."""
    return decode_reservation_after_prefill(len(req.origin_input_ids), len(req.output_ids),
                                            req.sampling_params.max_new_tokens, cfg, dense)
