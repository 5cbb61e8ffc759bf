"""The `megatron` section of the run config: the Megatron learner's parallel layout and model options.

Importable without megatron-core (the run config holds this section whichever learner runs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from slime_sparse.flags import flag_for
from slime_sparse.utils.checkpoint import MODEL_DIR, STATE_FILE


# the file every Megatron-LM (and slime) checkpoint directory holds
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-specific knobs (flags `--tensor-model-parallel-size`, ... as in Megatron-LM / slime)."""

    tensor_model_parallel_size: int = field(default=1, metadata={"help": "Megatron tensor-parallel ranks"})
    pipeline_model_parallel_size: int = field(default=1, metadata={"help": "Megatron pipeline-parallel stages"})
    sequence_parallel: bool = field(default=False, metadata={"help": "Megatron sequence parallelism (needs TP > 1)"})
    use_te: bool | None = field(default=None, metadata={"help": (
        "Transformer Engine layer spec; unset: when TE imports on a GPU")})
    load: str = field(default="", metadata={"help": (
        "a Megatron checkpoint made by tools/convert_hf_to_megatron.py: the Megatron learner starts from it (and "
        "keeps it as the KL reference) instead of --hf-checkpoint; slime's --ref-load, in our converter's layout")})
    vocab_divisible_by: int = field(default=128, metadata={"help": (
        "pad the vocabulary to a multiple of this (Megatron's)")})
    use_distributed_optimizer: bool = field(default=True, metadata={"help": (
        "GPU only: Megatron's distributed optimizer (Adam state sharded over data-parallel ranks, the same update). "
        "Megatron's default is off; on here for the memory")})

    def validate(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "vocab_divisible_by"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag_for('megatron', name)} must be >= 1, got {getattr(self, name)}")

    def check_inputs(self) -> None:
        """--ref-load is our converter's Megatron checkpoint (at start-up, not when the config is built)."""
        load = flag_for("megatron", "load")
        if self.load and not os.path.isdir(self.load):
            raise ValueError(f"{load}={self.load!r} is not a directory")
        if self.load and os.path.isfile(os.path.join(self.load, MEGATRON_LM_TRACKER)):
            raise ValueError(
                f"{load}={self.load!r} is a Megatron-LM checkpoint (slime's converter): give our converter's output "
                f"(tools/convert_hf_to_megatron.py), or drop {load} to start from {flag_for('train', 'hf_checkpoint')}"
            )
        if self.load and os.path.isfile(os.path.join(self.load, STATE_FILE)):
            raise ValueError(
                f"{load}={self.load!r} is a training checkpoint, not a Megatron checkpoint: start from its "
                f"weights with {flag_for('train', 'hf_checkpoint')} {os.path.join(self.load, MODEL_DIR)}, or resume "
                f"its run with {flag_for('train', 'load')}"
            )
