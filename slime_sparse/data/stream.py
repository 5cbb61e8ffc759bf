"""The prompt stream: batches of prompts epoch after epoch, in a per-epoch order, resumable per prompt (slime's data
source). A batch that reaches the end of an epoch is completed with the first prompts of the next (carry-over),
so no prompt is dropped at epoch boundaries."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


@dataclass(frozen=True)
class PromptRecord:
    """A prompt as the stream hands it out."""

    index: int  # global stream position: epoch * len(dataset) + position in that epoch; unique across epochs
    prompt_ids: list[int]
    prompt_text: str
    label: Any
    metadata: dict
    epoch: int
    row: int  # 0-based data row in the source file



class PromptStream:
    """Batches of `batch_size` (--rollout-batch-size) prompts, epoch after epoch, resumable per prompt.

    Epoch e visits every prompt once, in the order of a permutation drawn from an RNG seeded by
    (cfg.seed, e) (dataset order when cfg.shuffle is False). Batches carry over epoch boundaries: a batch
    that reaches the end of epoch e is completed with the first prompts of epoch e + 1.

    `num_batches = num_epochs * len(dataset) // batch_size` is the rollout count that --num-epoch stands
    for (slime's default --num-rollout); iterating the stream yields exactly the batches left of it, so
    the last `num_epochs * len(dataset) % batch_size` prompts (less than a batch) are not handed out.
    `next_batch()` itself never runs dry: past the --num-epoch budget it keeps going with fresh epochs,
    as slime does when --num-rollout asks for more rollouts than the epochs hold.

    The position is one counter, `consumed` (prompts handed out so far); `state_dict()` stores it with the
    settings that fix the order, and `load_state_dict()` refuses a state whose order would differ, so a
    resumed run continues with no prompt repeated or lost.
    """

    def __init__(self, dataset, batch_size: int) -> None:
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"--rollout-batch-size must be an int >= 1, got {batch_size!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = dataset.cfg.shuffle
        self.seed = dataset.cfg.seed
        self.num_epochs = dataset.cfg.num_epochs
        self.consumed = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(0)

    @property
    def num_batches(self) -> int:
        """Full batches in --num-epoch epochs."""
        return self.num_epochs * len(self.dataset) // self.batch_size

    @property
    def batches_left(self) -> int:
        """Full batches left of the --num-epoch budget."""
        return max(0, self.num_epochs * len(self.dataset) - self.consumed) // self.batch_size

    @property
    def epoch(self) -> int:
        """Epoch of the next prompt to be handed out."""
        return self.consumed // len(self.dataset)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset positions in the order epoch `epoch` visits them."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        # Seeding with the pair (seed, epoch) gives independent streams: (1, 1) and (2, 0) never collide.
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self, size: int | None = None) -> list[PromptRecord]:
        """The next `size` prompts (default `batch_size`; possibly spanning an epoch boundary)."""
        size = self.batch_size if size is None else size
        n = len(self.dataset)
        batch = []
        for index in range(self.consumed, self.consumed + size):
            epoch, pos = divmod(index, n)
            if epoch != self._order_epoch:
                if epoch == self.num_epochs and pos == 0:
                    logger.info("prompt stream: --num-epoch=%d done, starting epoch %d", self.num_epochs, epoch)
                self._order, self._order_epoch = self.epoch_order(epoch), epoch
            p = self.dataset[int(self._order[pos])]
            batch.append(record_of(p, index=index, epoch=epoch))
        self.consumed += size
        return batch

    def put_back(self, count: int) -> None:
        """Return the last `count` prompts handed out: the next batch starts with them, same order and indices
        (dynamic sampling gives back the groups a rollout generated but did not need)."""
        if not is_int(count) or not 0 <= count <= self.consumed:
            raise ValueError(f"cannot put back {count!r} prompts: {self.consumed} were handed out")
        self.consumed -= count

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        """The batches left of the --num-epoch budget."""
        for _ in range(self.batches_left):
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position of the stream."""
        return {
            "version": _STATE_VERSION,
            "consumed": self.consumed,
            "num_prompts": len(self.dataset),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`. The batch size and epoch count may change; the prompt order may not."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')!r} is not {_STATE_VERSION}")
        expected = {"num_prompts": len(self.dataset), "shuffle": self.shuffle, "seed": self.seed}
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed:
            details = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in changed.items())
            raise ValueError(
                "cannot resume the prompt stream: the prompt order would differ "
                f"({details}); keep --prompt-data, --rollout-max-prompt-len, --rollout-shuffle and --rollout-seed"
            )
        consumed = state.get("consumed")
        if not is_int(consumed) or consumed < 0:
            raise ValueError(f"data state 'consumed' must be a non-negative int, got {consumed!r}")
        self.consumed = consumed


def record_of(p, *, index: int, epoch: int) -> PromptRecord:
    """The record of dataset prompt `p` (a `Prompt`) at stream position `index`."""
    # Copies: a caller editing a record's ids or metadata must not change the dataset for later epochs.
    return PromptRecord(
        index=index,
        prompt_ids=list(p.prompt_ids),
        prompt_text=p.prompt_text,
        label=p.label,
        metadata=dict(p.metadata),
        epoch=epoch,
        row=p.row,
    )


def is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
