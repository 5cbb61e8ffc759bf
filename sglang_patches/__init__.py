"""Our SGLang changes, as an SGLang general plugin: a KV cache bounded by the same budget and selection code
(slime_sparse.kv) as the embedded engine. See README.md; the pinned SGLang version is in version.py."""
