"""The rollout (slime's `rollout` package): the engines behind one protocol (`base.py`, `sampling.py`, `embedded/`,
`sglang/`), and above them the default rollout function (`sparse_rollout.py`), its dynamic-sampling filters
(`filter_hub.py`), partial rollouts (`partial.py`), what a rollout function returns (`base_types.py`) and the
samples-to-batch pipeline (`pipeline.py`: the correction, once per sample). Engines import nothing of the layer above.

The engines and the pipeline are imported from their modules so that `import slime_sparse.rollout` stays light.
"""
from .base import RolloutEngine
from .sampling import SamplingParams

__all__ = ["RolloutEngine", "SamplingParams"]
