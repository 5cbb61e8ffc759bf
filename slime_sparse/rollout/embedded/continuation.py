"""A continuation's row (--partial-rollout, `Sequence.continuing`): its prefill replays the compressions of the record
it continues where they happened, then it decodes on from its last sampled token and its own random stream."""
from __future__ import annotations

from slime_sparse.rollout.sampling import SamplingParams

from .rows import Rows
from .sequence import Sequence


def replay_and_resume(rows: Rows, seq: Sequence, row: int, params: SamplingParams, context: int) -> None:
    """After a prefill chunk of a continuation: replay the compressions recorded right there (`Rows.replay`: nothing
    is recorded, the continuation's output starts from the record it continues), and once its tokens are all in, set
    its row up to decode on: it runs its last sampled token next and samples response token n from its own stream
    (so, under unchanged weights, it draws what an uninterrupted run would have)."""
    while seq.replay and seq.replay[0][0] == seq.processed:
        rows.replay(row, seq.replay.pop(0)[1])
    if seq.processed == len(seq.prefill_tokens):
        n = len(seq.response)
        rows.resume(row, seq.response[-1], len(seq.prompt) + n - 1, seq.key, n,
                    min(params.max_new_tokens, context - len(seq.prompt)))
