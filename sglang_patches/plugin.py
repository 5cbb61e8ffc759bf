"""SGLang general plugin: entry point `register`, found through the setuptools group `sglang.srt.plugins`.

SGLang calls load_plugins() early in every process (launcher, each scheduler): it runs each plugin's function
then HookRegistry.apply_hooks(). Installing slime_sparse declares (setup.py entry_points):

    "sglang.srt.plugins": ["slime_sparse_kv = sglang_patches.plugin:register"]

register() does nothing unless SLIME_SPARSE_KV_CONFIG selects a compression method, so an installed plugin leaves
ordinary SGLang servers untouched.
"""
from __future__ import annotations

import logging

from .hooks import HOOKS
from .settings import config_from_environ
from .version import SGLANG_VERSION

logger = logging.getLogger(__name__)


def register() -> None:
    """Register our hooks with SGLang's HookRegistry (applied by load_plugins right after)."""
    cfg = config_from_environ()  # a malformed config raises here, with the variable named
    if cfg is None:
        return
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if sglang.__version__ != SGLANG_VERSION:
        # The contract (sglang_patches.contract) was checked against SGLANG_VERSION only.
        logger.warning(
            "slime_sparse hooks were written for SGLang %s but %s is installed; run "
            "`python -m sglang_patches.contract` to check the hooked code", SGLANG_VERSION, sglang.__version__
        )
    for spec in HOOKS:
        HookRegistry.register(spec.target, spec.hook, HookType[spec.hook_type])
    logger.info("slime_sparse budgeted KV cache: %s", cfg)

