"""The embedded rollout engine: pure PyTorch over transformers models, with a budgeted KV cache."""
from .engine import EmbeddedEngine
from .sequence import KVTraceRecord

__all__ = ["EmbeddedEngine", "KVTraceRecord"]
