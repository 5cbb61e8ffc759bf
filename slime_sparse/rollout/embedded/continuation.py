"""A continuation's row (--partial-rollout, `Sequence.continuing`): its prefill replays the compressions of the record
it continues where they happened, then it decodes on from its last sampled token and its own random stream."""
from __future__ import annotations

import torch
from torch import Tensor

from slime_sparse.rollout.sampling import SamplingParams

from .cache import BudgetKVCache
from .runner import ModelRunner
from .sequence import Sequence
from .table import RowTable


def prefilled(runner: ModelRunner, table: RowTable, seq: Sequence, row: int, params: SamplingParams,
              context: int) -> None:
    """After a prefill chunk of a continuation: replay the compressions recorded right there, and once its tokens
    are all in, set its row up to decode on."""
    while seq.replay and seq.replay[0][0] == seq.processed:
        replay_compression(runner.cache, table, row, seq.replay.pop(0)[1])
    if seq.processed == len(seq.prefill_tokens):
        continue_decoding(runner, table, seq, row, params, context)


def replay_compression(cache: BudgetKVCache, table: RowTable, row: int, bits: list[Tensor]) -> None:
    """One recorded compression on `row`: per stored layer (one for all layers, or one each), keep the slots whose
    keep bit is set ([H', n] bits; slots are in position order, as the record's bits are). Nothing is recorded: the
    continuation's output starts from the record it continues."""
    shared = len(bits) == 1
    layer_sets = [list(range(cache.num_layers))] if shared else [[layer] for layer in range(cache.num_layers)]
    device = cache.device
    for layers, layer_bits in zip(layer_sets, bits):
        held = {int(table.fill[layer, row]) for layer in layers}
        if held != {layer_bits.shape[-1]}:
            raise RuntimeError(f"replaying a compression of {layer_bits.shape[-1]} slots on a row holding "
                               f"{sorted(held)}: the continuation's prefill left the recorded path")
        kept = torch.stack([head.nonzero().flatten() for head in layer_bits])  # [H', k]: every head keeps k
        cache.compact(torch.tensor(layers, device=device), torch.tensor([row], device=device),
                      kept.to(device)[None, None], torch.full((len(layers),), kept.shape[-1], device=device))
        table.fill[layers, row] = kept.shape[-1]


def continue_decoding(runner: ModelRunner, table: RowTable, seq: Sequence, row: int, params: SamplingParams,
                      context: int) -> None:
    """The continuation's prefill is done: its row runs its last sampled token next and samples response token n
    from its own stream (so, under unchanged weights, it draws what an uninterrupted run would have)."""
    n, device = len(seq.response), runner.device
    index = torch.tensor([row], device=device)
    position = torch.tensor([len(seq.prompt) + n - 1], device=device)
    runner.state.set_rows(index, torch.tensor([seq.response[-1]], device=device), position,
                          torch.tensor([seq.key], device=device))
    runner.state.counters[index] = n
    table.issued[row] = n
    table.limit[row] = min(params.max_new_tokens, context - len(seq.prompt))
