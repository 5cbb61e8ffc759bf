"""The embedded tasks and their assets: data, char tokenizer, tiny Qwen2, supervised warm start.

repeated_add is the default task (short worked answers that restate their state); long_recall is the
long-horizon one (a ~350-token worked answer whose end needs keys stated only in the prompt).

    from slime_sparse.tasks import AssetsConfig, build_assets, task_reward
    paths = build_assets("~/.cache/slime_sparse")  # cached by a hash of the parameters
"""
from slime_sparse.tasks.assets import AssetPaths, AssetsConfig, build_assets, load_rows
from slime_sparse.tasks.long_recall import LongRecallConfig
from slime_sparse.tasks.repeated_add import RepeatedAddConfig, generate_dataset, task_reward, with_direct_answers
from slime_sparse.tasks.tiny_model import TinyModelConfig, build_tiny_model
from slime_sparse.tasks.tokenizer import build_char_tokenizer, load_tokenizer
from slime_sparse.tasks.warm_start import WarmStartConfig, warm_start

__all__ = [
    "AssetPaths",
    "AssetsConfig",
    "LongRecallConfig",
    "RepeatedAddConfig",
    "TinyModelConfig",
    "WarmStartConfig",
    "build_assets",
    "build_char_tokenizer",
    "build_tiny_model",
    "generate_dataset",
    "load_rows",
    "load_tokenizer",
    "task_reward",
    "warm_start",
    "with_direct_answers",
]
