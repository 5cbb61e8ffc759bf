"""Run configuration: slime flag names, YAML + CLI precedence, presets, validation naming the flag."""
import pytest

from slime_sparse.algo.correction import CorrectionConfig
from slime_sparse.config import SECTIONS, RunConfig
from slime_sparse.config_loader import build_parser, load_config, save_config
from slime_sparse.flags import SECTION_PREFIXES


def test_slime_flag_names_exist():
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    for flag in ["--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size", "--eps-clip",
                 "--eps-clip-high", "--use-kl-loss", "--kl-loss-coef", "--kl-loss-type", "--advantage-estimator",
                 "--rollout-max-response-len", "--rollout-temperature", "--rm-type", "--custom-rm-path", "--lr",
                 "--num-rollout", "--hf-checkpoint", "--prompt-data", "--input-key", "--label-key",
                 "--apply-chat-template", "--rollout-max-prompt-len", "--save", "--kv-method", "--kv-budget"]:
        assert flag in flags, flag


def test_cli_values_are_typed(base_args):
    cfg = load_config(base_args + ["--rollout-batch-size", "16", "--n-samples-per-prompt", "4", "--global-batch-size",
                                   "32", "--eps-clip", "0.1", "--use-kl-loss", "--kl-loss-coef", "1e-3",
                                   "--rollout-stop-token-ids", "3,4", "--kv-method", "rkv", "--kv-budget", "64"])
    assert cfg.rollout.rollout_batch_size == 16 and cfg.rollout.n_samples_per_prompt == 4
    assert cfg.loss.eps_clip == 0.1 and cfg.loss.use_kl_loss is True and cfg.loss.kl_loss_coef == 1e-3
    assert cfg.sampling.stop_token_ids == (3, 4)
    assert cfg.kv.method == "rkv" and cfg.kv.budget == 64
    assert cfg.steps_per_rollout == 2


def test_yaml_then_flags_precedence(base_args, tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("loss: {eps_clip: 0.3, eps_clip_high: 0.28}\nkv: {method: snapkv, budget: 100}\n")
    cfg = load_config(base_args + ["--config", str(y), "--kv-budget", "200"])
    assert cfg.loss.eps_clip == 0.3 and cfg.loss.eps_clip_high == 0.28
    assert cfg.kv.method == "snapkv" and cfg.kv.budget == 200


def test_correction_presets_and_overrides(base_args):
    mis = load_config(base_args + ["--correction-preset", "mis"]).correction
    assert (mis.is_upper, mis.token_mask_low, mis.token_mask_high, mis.seq_veto, mis.batch_normalize) == (
        1.5, 0.5, 1.5, 1e-4, True)
    tweaked = load_config(base_args + ["--correction-preset", "mis", "--correction-seq-veto", "1e-3"]).correction
    assert tweaked.seq_veto == 1e-3 and tweaked.is_upper == 1.5
    none = load_config(base_args).correction
    assert not none.is_weight and none.seq_veto is None


def test_dr_grpo_norm_len_defaults_to_response_budget(base_args):
    cfg = load_config(base_args + ["--loss-agg-mode", "seq-mean-token-sum-norm", "--rollout-max-response-len", "77"])
    assert cfg.loss.norm_len == 77


@pytest.mark.parametrize("extra, flag", [
    (["--kv-method", "magic"], "--kv-method"),
    (["--kv-method", "rkv", "--kv-budget", "8", "--kv-window", "8"], "--kv-budget"),
    (["--eps-clip", "-0.1"], "--eps-clip"),
    (["--loss-agg-mode", "sum"], "--loss-agg-mode"),
    (["--global-batch-size", "300"], "--global-batch-size"),
    (["--rollout-batch-size", "abc"], "--rollout-batch-size"),
    (["--correction-preset", "bogus"], "preset"),
    (["--train-backend", "jax"], "--train-backend"),
    (["--rm-type", "nope"], "--rm-type"),
    # one sample per prompt: GRPO's group baseline makes every advantage 0 (refused, not warned)
    (["--n-samples-per-prompt", "1", "--global-batch-size", "128"], "--n-samples-per-prompt=1 .* advantage 0"),
    (["--n-samples-per-prompt", "1", "--global-batch-size", "128", "--advantage-estimator", "dr_grpo"],
     "--n-samples-per-prompt"),
    (["--eval-kv-method", "none"], "--eval-kv-method"),
    (["--eval-kv-method", "rkv", "--kv-budget", "8", "--kv-window", "8"], "--kv-budget"),
    (["--loss-type", "policy_loss"], "--loss-type"),
    (["--loss-type", "smd", "--smd-kl-coef", "-1"], "--smd-kl-coef"),
    (["--loss-type", "smd", "--train-backend", "megatron"], "--loss-type smd needs --train-backend embedded"),
])
def test_invalid_values_name_the_flag(base_args, extra, flag):
    with pytest.raises(ValueError, match=flag):
        load_config(base_args + extra)


@pytest.mark.parametrize("loss_type", ["shadow", "smd"])
def test_shadow_losses_run_on_the_sglang_engine(base_args, loss_type):
    """The SGLang plugin ships each sample's eviction record (sglang_patches/evictions.py), so both are accepted."""
    cfg = load_config(base_args + ["--loss-type", loss_type, "--rollout-engine", "sglang"])
    assert (cfg.loss.loss_type, cfg.rollout.engine) == (loss_type, "sglang")


def test_missing_files_are_errors(tmp_path, base_args):
    with pytest.raises(ValueError, match="--prompt-data"):
        load_config(["--prompt-data", str(tmp_path / "none.jsonl"), "--hf-checkpoint", str(tmp_path)])
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        load_config(base_args[:2] + ["--hf-checkpoint", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--config"):
        load_config(base_args + ["--config", str(tmp_path / "x.yaml")])


def test_yaml_unknown_section_or_field(base_args, tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("kvv: {budget: 1}\n")
    with pytest.raises(ValueError, match="unknown section"):
        load_config(base_args + ["--config", str(y)])
    y.write_text("kv: {budgit: 1}\n")
    with pytest.raises(ValueError, match="kv.budgit"):
        load_config(base_args + ["--config", str(y)])


@pytest.mark.parametrize("text,message", [
    ("train: {lr: many}\n", "train.lr: expected a number, got 'many'"),
    ('loss: {use_kl_loss: "no"}\n', "loss.use_kl_loss: expected a boolean (true / false), got 'no'"),
    ("rollout: {rollout_batch_size: 2.5}\n", "rollout.rollout_batch_size: expected an integer, got 2.5"),
    ("kv: {n_sink: true}\n", "kv.n_sink: expected an integer or null, got True"),
    ("sampling: {stop_token_ids: [1, x]}\n", "sampling.stop_token_ids: expected a list of integers, got [1, 'x']"),
    ("train: {lr: 1e-3\n", "not valid YAML at line 2, column 1"),
    ("- train\n", "must be a mapping {section: {field: value}}, got a list"),
])
def test_a_bad_yaml_value_is_one_line_naming_file_key_and_type(base_args, tmp_path, text, message, capsys):
    from slime_sparse.train import main

    y = tmp_path / "c.yaml"
    y.write_text(text)
    with pytest.raises(ValueError, match="--config " + str(y)) as err:
        load_config(base_args + ["--config", str(y)])
    assert message in str(err.value)
    assert main(base_args + ["--config", str(y)]) == 2  # the command: one line, no traceback
    assert capsys.readouterr().err.strip() == f"error: {err.value}"


def test_yaml_values_keep_their_type(base_args, tmp_path):
    y = tmp_path / "c.yaml"
    # PyYAML reads 1e-6 (no dot) as a string: a number field takes it; a one-element list may be written bare
    y.write_text("train: {lr: 1e-6, num_rollout: 3}\nloss: {use_kl_loss: false}\nsampling: {stop_token_ids: 7}\n")
    cfg = load_config(base_args + ["--config", str(y)])
    assert cfg.train.lr == 1e-6 and cfg.train.num_rollout == 3 and cfg.loss.use_kl_loss is False
    assert cfg.sampling.stop_token_ids == (7,)


def test_defaults_follow_the_authors_recipe():
    cfg = RunConfig()
    assert cfg.rollout.rollout_batch_size == 128 and cfg.rollout.n_samples_per_prompt == 8
    assert cfg.train.global_batch_size == 256 and cfg.train.lr == 1e-6 and cfg.train.weight_decay == 0.1
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2) == (0.9, 0.98)
    assert cfg.loss.eps_clip == 0.2


def test_without_correction_flags_the_config_reports_the_preset_it_equals(base_args):
    assert load_config(base_args).correction.preset == "none"
    assert CorrectionConfig().preset == "none"
    paper = load_config(base_args + ["--correction-is-weight", "--correction-seq-veto", "1e-4"]).correction
    assert paper.preset == "paper"
    assert load_config(base_args + ["--correction-is-weight"]).correction.preset == "custom"
    assert load_config(base_args + ["--correction-preset", "mis", "--correction-seq-veto", "1e-3"]).correction.preset \
        == "mis"  # the preset it started from


def test_stop_ids_are_the_tokenizers_eos_unless_given(tiny_assets):
    from transformers import AutoTokenizer

    assets = tiny_assets(n_train=16)
    args = ["--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path)]
    eos = AutoTokenizer.from_pretrained(str(assets.model_dir)).eos_token_id
    assert load_config(args).sampling.stop_token_ids == (eos,)
    assert load_config(args + ["--rollout-stop-token-ids", "5"]).sampling.stop_token_ids == (5,)


def test_a_saved_config_loads_back_to_itself(base_args, tmp_path):
    cfg = load_config(base_args + ["--correction-preset", "mis", "--correction-seq-veto", "1e-3", "--kv-method", "rkv",
                                   "--loss-agg-mode", "seq-mean-token-sum-norm", "--sglang-foo", "1"])
    save_config(cfg, str(tmp_path / "run.yaml"))
    assert load_config(["--config", str(tmp_path / "run.yaml")]) == cfg


def test_every_section_has_a_flag_prefix_and_every_flag_one_owner():
    assert tuple(SECTION_PREFIXES) == SECTIONS
    dests = [a.dest for a in build_parser()._actions if a.dest not in ("help", "config")]
    assert len(dests) == len(set(dests)) and "correction.preset" in dests


@pytest.mark.parametrize("extra, message", [
    # SGLang: one req_to_token row per request, shared by every layer and head (sglang_patches/settings.py)
    (["--rollout-engine", "sglang", "--kv-method", "rkv"], "--kv-granularity='head' is not supported by the SGLang"),
    # ... and so one budget for every layer (one set for all layers cannot be kept at several sizes)
    (["--rollout-engine", "sglang", "--kv-method", "pyramidkv", "--kv-granularity", "model"],
     "--kv-granularity='model' is invalid: model needs one budget for every layer"),
    (["--rollout-engine", "sglang", "--kv-method", "pyramidkv"], "--kv-granularity='head' is not supported by the SGLang"),
    (["--kv-method", "rkv", "--kv-layer-budgets", "64", "32"], "--kv-layer-budgets"),
    (["--kv-method", "keydiff", "--kv-preset", "sparse-rl-fork"], "--kv-preset='sparse-rl-fork' is invalid: has no settings for "
                                                                  "--kv-method=keydiff"),
    (["--kv-method", "snapkv", "--kv-preset", "kvpress", "--kv-budget", "64"], "--kv-budget=64 .* window \\+ sinks = 64"),
    (["--kv-preset", "nope"], "--kv-preset='nope'"),
])
def test_kv_settings_the_engine_cannot_run_fail_at_config_load(base_args, extra, message):
    with pytest.raises(ValueError, match=message):
        load_config(base_args + extra)


def test_per_layer_budgets_load_for_the_embedded_engine(base_args):
    cfg = load_config(base_args + ["--kv-method", "pyramidkv", "--kv-budget", "64"]).kv
    assert (cfg.schedule, cfg.preset, cfg.pyramid_beta) == ("pyramid", "sparse-rl-fork", 10.0)
    cfg = load_config(base_args + ["--kv-method", "rkv", "--kv-budget-schedule", "explicit", "--kv-layer-budgets",
                                   "64", "32", "--kv-granularity", "layer"]).kv
    assert cfg.layer_budgets == (64, 32)


def test_sglang_kv_settings_it_can_run_load(base_args):
    cfg = load_config(base_args + ["--rollout-engine", "sglang", "--kv-method", "keydiff", "--kv-granularity", "model"])
    assert (cfg.kv.method, cfg.kv.schedule, cfg.kv.preset) == ("keydiff", "uniform", "custom")


def test_kv_presets_set_their_knobs_and_flags_override_them(base_args):
    default = load_config(base_args + ["--kv-method", "snapkv"]).kv
    assert (default.preset, default.window, default.kernel_size, default.pooling, default.gqa_reduce) == (
        "sparse-rl-fork", 8, 7, "max", "max")  # today's behaviour, named
    kvpress = load_config(base_args + ["--kv-method", "snapkv", "--kv-preset", "kvpress", "--kv-budget", "128"]).kv
    assert (kvpress.preset, kvpress.window, kvpress.kernel_size, kvpress.pooling, kvpress.gqa_reduce) == (
        "kvpress", 64, 5, "avg", "mean")
    narrow = load_config(base_args + ["--kv-method", "snapkv", "--kv-preset", "kvpress", "--kv-window", "8"]).kv
    assert (narrow.preset, narrow.window, narrow.pooling) == ("kvpress", 8, "avg")  # flags over the preset
    rkv = load_config(base_args + ["--kv-method", "rkv", "--kv-preset", "rkv-code"]).kv
    assert rkv.mix_lambda == 0.07
    assert load_config(base_args + ["--kv-method", "rkv", "--kv-mix-lambda", "0.07"]).kv.preset == "rkv-code"
    assert load_config(base_args + ["--kv-method", "rkv", "--kv-mix-lambda", "0.2"]).kv.preset == "custom"


def test_kv_preset_help_names_the_default_and_why(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-preset" in text and "sparse-rl-fork | rkv-code | kvpress" in text
    assert "defaults are sparse-rl-fork's, the settings the Sparse-RL results were produced with" in text


def test_saved_kv_config_loads_back_equal(base_args, tmp_path):
    cfg = load_config(base_args + ["--kv-method", "snapkv", "--kv-preset", "kvpress", "--kv-window", "8"])
    path = tmp_path / "c.yaml"
    save_config(cfg, str(path))
    assert load_config(["--config", str(path)]).kv == cfg.kv


USER_HOOKS = """\
def rollout(args, rollout_id, data_source, evaluation=False):
    raise AssertionError("not called")


def keep(cfg, samples):
    return True


def grade(response, label, **kwargs):
    return 0.0
"""


def test_building_a_config_touches_no_file_and_imports_no_user_module(tmp_path, monkeypatch):
    """Building (flags -> RunConfig, validated) reads no file and imports nothing: the model directory, the data
    files and the user's functions are read at start-up (load_config, slime_sparse.startup), not by the config."""
    from slime_sparse.config_loader import parse_config

    (tmp_path / "my_user_hooks.py").write_text(USER_HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--hf-checkpoint", str(tmp_path / "no_model"), "--prompt-data", str(tmp_path / "no_data.jsonl"),
            "--eval-prompt-data", "test", str(tmp_path / "no_test.jsonl"), "--load", str(tmp_path / "no_ckpt"),
            "--rollout-function-path", "my_user_hooks.rollout", "--dynamic-sampling-filter-path", "my_user_hooks.keep",
            "--custom-rm-path", "my_user_hooks:grade", "--rollout-engine", "sglang", "--kv-method", "rkv",
            "--kv-granularity", "model", "--ref-load", str(tmp_path / "no_megatron"), "--train-backend", "megatron"]
    touched, imported = [], []

    class Watch:  # the first finder asked for every import
        def find_spec(self, name, path=None, target=None):
            imported.append(name)
            return None

    import builtins
    import io
    import os

    def deny(module, name, only_ours=False):
        real = getattr(module, name)

        def call(*args, **kwargs):
            if only_ours and not str(args[0] if args else "").startswith(str(tmp_path)):
                return real(*args, **kwargs)  # argparse's gettext looks for its locale files
            touched.append((name, args[:1]))
            raise AssertionError(f"{name}{args[:1]} while building a config")
        return call

    with monkeypatch.context() as m:
        m.setattr("sys.meta_path", [Watch(), *__import__("sys").meta_path])
        for name in ("stat", "lstat", "access", "listdir", "scandir"):  # nothing the config names is looked at
            m.setattr(os, name, deny(os, name, only_ours=True))
        for module in (os, builtins, io):  # and no file is opened
            m.setattr(module, "open", deny(module, "open"))
        cfg, arch = parse_config(argv)
    assert touched == [] and imported == []
    assert "my_user_hooks" not in __import__("sys").modules
    assert (cfg.rollout.rollout_function_path, cfg.reward.custom_rm_path) == ("my_user_hooks.rollout",
                                                                              "my_user_hooks:grade")
    assert cfg.sampling.stop_token_ids == () and arch == {}  # the model's EOS is filled in at start-up
    # the same command line, loaded to run: the start-up checks find what the config names
    with pytest.raises(ValueError, match="--hf-checkpoint="):
        load_config(argv)
