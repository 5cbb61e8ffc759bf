import pytest

from slime_sparse.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()
