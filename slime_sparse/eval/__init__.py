"""Evaluation: the library (modes.py: pass@k under dense and compressed-KV inference, what the training loop calls)
and its command, `slime-sparse-eval` (cli.py; `python -m slime_sparse.eval`). Importing the package imports the
library alone."""
from .modes import (EVAL_KV, eval_key, eval_kv, eval_sampling, evaluate, evaluate_modes, load_eval_sets,
                    score_outputs, sparse_eval_kv)

__all__ = ["EVAL_KV", "eval_key", "eval_kv", "eval_sampling", "evaluate", "evaluate_modes", "load_eval_sets",
           "score_outputs", "sparse_eval_kv"]
