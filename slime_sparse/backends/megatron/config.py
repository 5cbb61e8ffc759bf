"""The `megatron` section of the run config: the Megatron learner's parallel layout and model options.

Importable without megatron-core (the run config holds this section whichever learner runs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from slime_sparse.flags import flag_for
from slime_sparse.utils.checkpoint import MODEL_DIR, STATE_FILE


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-specific knobs (flags `--tensor-model-parallel-size`, ... as in Megatron-LM / slime)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_te: bool | None = None  # None: Transformer Engine spec iff TE imports on a GPU
    load: str = ""  # Megatron checkpoint (a converter's output) to start from, else the HF checkpoint
    vocab_divisible_by: int = 128
    recompute_activations: bool = False
    use_distributed_optimizer: bool = True  # GPU only

    def validate(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "vocab_divisible_by"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag_for('megatron', name)} must be >= 1, got {getattr(self, name)}")
        load = flag_for("megatron", "load")
        if self.load and not os.path.isdir(self.load):
            raise ValueError(f"{load}={self.load!r} is not a directory")
        if self.load and os.path.isfile(os.path.join(self.load, STATE_FILE)):
            raise ValueError(
                f"{load}={self.load!r} is a training checkpoint, not a Megatron checkpoint: start from its "
                f"weights with {flag_for('train', 'hf_checkpoint')} {os.path.join(self.load, MODEL_DIR)}, or resume "
                f"its run with {flag_for('train', 'save')}"
            )
