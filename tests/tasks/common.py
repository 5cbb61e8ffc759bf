"""What the task tests share: a micro model config, and an interrupt after n calls."""
from slime_sparse.tasks.tiny_model import TinyModelConfig

MICRO_MODEL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def raise_after(fn, n):
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > n:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)
    return wrapped
