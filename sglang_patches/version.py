"""The one SGLang version our hooks were read from and are checked against (setup.py's `sglang` extra reads it).

0.5.15.post1 is slime's pin: the hook points in docs/engines.md were read from it, and it has the plugin
entry point (setuptools group `sglang.srt.plugins`) and `HookRegistry` we register through.
"""

SGLANG_VERSION = "0.5.15.post1"
