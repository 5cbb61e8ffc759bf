
import pytest
import torch

# Tiny tensors: one thread is fastest, and OpenMP spinning on shared cores costs seconds per test.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
