"""The KV-compression methods, one module each, registered by name in this order (`REGISTRY`): see base.py."""
from .base import REGISTRY, KVMethod, knob, register
from .snapkv import SnapKV  # noqa: I001  (import order = registry order = the CLI's)
from .rkv import RKV, newest_duplicate, rkv_redundancy
from .streaming import StreamingLLM
from .h2o import H2O
from .pyramidkv import PyramidKV
from .keydiff import KeyDiff

__all__ = ["H2O", "KVMethod", "KeyDiff", "PyramidKV", "REGISTRY", "RKV", "SnapKV", "StreamingLLM", "knob",
           "newest_duplicate", "register", "rkv_redundancy"]
