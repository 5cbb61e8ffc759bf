"""The pinned SGLang source and a CPU import environment for it, built from the package registry on demand.

Never `pip install sglang` on a CPU machine: it pins a CUDA torch. Here:
- fetch_sglang_source: `pip download sglang==PIN --no-deps` and unzip the wheel (the contract tests parse it);
- prepare_cpu_import_env: also `pip install --no-deps --target` the light pure-Python modules SGLang imports at
  module level, plus a torchvision stub, all under a cache directory (default <repo>/.cache, ignored by git);
- activate_cpu_import_env: put them on sys.path so `sglang.srt.mem_cache.*` imports on CPU, in THIS process.

Two adjustments make SGLang importable next to the system's newer transformers (never done on a GPU node):
transformers' torchvision probe is run before the stub is visible (so transformers keeps thinking torchvision is
absent), and AutoConfig.register tolerates SGLang re-registering config names that transformers now ships.
"""
from __future__ import annotations

import inspect
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .version import SGLANG_VERSION

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / ".cache"

# Modules imported at module level by the sglang.srt modules we hook or use (pools, batches, scheduler), at versions
# that worked with SGLang 0.5.15.post1, torch 2.13 CPU, Python 3.11. Installed with --no-deps: none pulls torch.
CPU_IMPORT_DEPS = (
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "compressed-tensors==0.20.0",
    "einops==0.8.2", "fastapi==0.165.0", "frozenlist==1.8.0", "gguf==0.19.0", "httpx==0.28.1",
    "loguru==0.7.3", "msgspec==0.22.0", "multidict==7.2.1", "openai==3.54.0",
    "partial-json-parser==0.2.1.1.post7", "propcache==0.5.4", "psutil==7.2.2", "pybase64==1.5.1",
    "pyzmq==27.3.0", "sentencepiece==0.2.3", "setproctitle==1.3.8", "starlette==1.10.0", "triton==3.9.0",
    "uvicorn==0.54.0", "yarl==1.25.1",
    # sglang/srt/configs/load_config.py (and the function-call parsers) import orjson; sglang/utils.py imports
    # IPython.display, whose package imports the rest of this line at module level (#45: a fresh venv lacked them)
    "orjson==3.8.3", "ipython==8.12.3", "asttokens==3.0.1", "backcall==0.2.0", "decorator==5.2.1",
    "executing==2.2.1", "jedi==0.20.0", "matplotlib-inline==0.2.2", "parso==0.8.7", "pexpect==4.8.0",
    "pickleshare==0.7.5", "prompt-toolkit==3.0.52", "ptyprocess==0.7.0", "pure-eval==0.2.3", "pygments==2.20.0",
    "stack-data==0.6.3", "traitlets==5.15.0", "wcwidth==0.7.0",
)

_TORCHVISION_STUB = '''"""Stand-in for torchvision: SGLang imports it at module level; the real wheel needs its own torch."""


class _Missing:
    def __getattr__(self, name):
        return _Missing()

    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision stub (slime_sparse CPU tests)")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing()
'''
_STUB_MODULES = (
    "__init__.py", "io.py", "transforms/__init__.py", "transforms/functional.py", "transforms/v2.py",
)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, stdout=subprocess.DEVNULL)


def fetch_sglang_source(version: str = SGLANG_VERSION, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Directory holding the unpacked `sglang/` package of the given version (downloaded once, then cached)."""
    target = cache_dir / f"sglang-src-{version}"
    if (target / "sglang" / "__init__.py").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        _pip("download", f"sglang=={version}", "--no-deps", "--only-binary", ":all:", "-d", tmp)
        wheels = sorted(Path(tmp).glob("sglang-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download sglang=={version} produced no wheel")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(unpacked)
        unpacked.rename(target)  # atomic: a half-extracted tree never looks complete
    return target


def prepare_cpu_import_env(version: str = SGLANG_VERSION, cache_dir: Path = DEFAULT_CACHE) -> list[Path]:
    """[source dir, stub dir, deps dir] for activate_cpu_import_env (built once, then cached)."""
    source = fetch_sglang_source(version, cache_dir)
    deps = cache_dir / "sglang-deps"
    marker = deps / f".complete-{version}"
    if not marker.is_file() or marker.read_text() != "\n".join(CPU_IMPORT_DEPS):  # a list changed: install again
        _pip("install", "--quiet", "--no-deps", "--upgrade", "--target", str(deps), *CPU_IMPORT_DEPS)
        marker.write_text("\n".join(CPU_IMPORT_DEPS))
    stubs = cache_dir / "sglang-stubs"
    for name in _STUB_MODULES:
        path = stubs / "torchvision" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_TORCHVISION_STUB)
    return [source, stubs, deps]


def activate_cpu_import_env(paths: list[Path]) -> None:
    """Make `import sglang...` work in this process (call before anything imports sglang)."""
    from transformers import AutoConfig
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached as False before the stub is on sys.path
    register = inspect.getattr_static(AutoConfig, "register")
    original = register.__func__ if isinstance(register, staticmethod) else register
    if not getattr(original, "_slime_sparse_tolerant", False):

        def tolerant_register(model_type, config, exist_ok=False):
            return original(model_type, config, exist_ok=True)

        tolerant_register._slime_sparse_tolerant = True
        AutoConfig.register = staticmethod(tolerant_register)
    for path in reversed(paths):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
