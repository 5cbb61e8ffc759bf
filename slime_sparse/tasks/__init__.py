"""The embedded default task and its assets: data, char tokenizer, tiny Qwen2, supervised warm start.

    from slime_sparse.tasks import AssetsConfig, build_assets, task_reward
    paths = build_assets("~/.cache/slime_sparse")  # cached by a hash of the parameters
"""
from slime_sparse.tasks.assets import AssetPaths, AssetsConfig, build_assets, load_rows
from slime_sparse.tasks.repeated_add import RepeatedAddConfig, generate_dataset, task_reward, with_direct_answers
from slime_sparse.tasks.tiny_model import TinyModelConfig, build_tiny_model
from slime_sparse.tasks.tokenizer import build_char_tokenizer, load_tokenizer
from slime_sparse.tasks.warm_start import WarmStartConfig, warm_start

__all__ = [
    "AssetPaths",
    "AssetsConfig",
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
