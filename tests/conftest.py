import os

import pytest
import torch

# Tiny tensors: one thread is fastest, and OpenMP spinning on shared cores costs seconds per test.
torch.set_num_threads(1)
# Triton kernels run on CPU tensors under Triton's interpreter, which is chosen when triton is imported: before any
# test module imports it (tests/kv/kernels/test_rkv_kernel.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def base_args(tmp_path):
    """The two flags every run needs, pointing at a one-row prompt file and an (empty) model directory: enough for
    the configuration to load and validate."""
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1 2=", "label": "3"}\n')
    model = tmp_path / "model"
    model.mkdir()
    return ["--prompt-data", str(data), "--hf-checkpoint", str(model)]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """Builder of the tiny task assets the end-to-end tests share: a ~20k-parameter random Qwen2 (no
    warm start), short repeated-addition problems, cached per `n_train` for the whole session."""
    from slime_sparse.tasks.assets import AssetsConfig, build_assets
    from slime_sparse.tasks.repeated_add import RepeatedAddConfig
    from slime_sparse.tasks.tiny_model import TinyModelConfig

    def build(n_train: int = 64):
        cfg = AssetsConfig(task=RepeatedAddConfig(min_count=2, max_count=4),
                           model=TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                 intermediate_size=64, max_position_embeddings=128),
                           warm_start=None, n_train=n_train, n_test=4)
        return build_assets(tmp_path_factory.getbasetemp() / "tiny_assets", cfg, log=None)

    return build


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster of 2 CPUs around one test module."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
