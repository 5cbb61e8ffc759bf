import os

import pytest
import torch

# Tests are sized for 2 shared cores; more threads only add contention.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
