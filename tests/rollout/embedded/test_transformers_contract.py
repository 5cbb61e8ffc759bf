"""The transformers surface the embedded engine relies on (#36): every assumption of
`slime_sparse/rollout/embedded/contract.py` holds for Qwen2 and Llama under the installed transformers.
`python tools/check_min_versions.py` runs this file at the lowest transformers setup.py allows; CI at the newest."""
import pytest

from slime_sparse.rollout.embedded.contract import ARCHITECTURES, check


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_assumption_holds(architecture):
    findings = check(architecture)
    assert len(findings) == 8
    broken = [f"{f.assumption} [{f.detail}]" for f in findings if not f.ok]
    assert not broken, broken


def test_a_broken_assumption_is_reported(monkeypatch):
    """The check can fail: a model that stops supporting the AttentionInterface is reported, not passed over."""
    import slime_sparse.rollout.embedded.contract as contract

    real = contract.tiny_model

    def unsupported(architecture):
        model = real(architecture)
        type(model)._supports_attention_backend = False
        return model

    monkeypatch.setattr(contract, "tiny_model", unsupported)
    try:
        findings = check("qwen2")
    finally:
        from transformers import Qwen2ForCausalLM

        Qwen2ForCausalLM._supports_attention_backend = True
    assert [f.assumption for f in findings if not f.ok] == ["the model supports the AttentionInterface"]
