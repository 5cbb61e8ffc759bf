"""The correction's configuration (slime_sparse/algo/correction_config.py): the presets equal to their published
definitions (the Sparse-RL paper, slime's MIS and TIS, verl's factories), validation naming the flag, sections and
checkpoints saved before the current knobs, the YAML keys."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from slime_sparse.algo import ALL_PRESETS, PRESETS, VERL_PRESETS, CorrectionConfig, sparsity_correction
from tests.algo.test_correction import knobs_of, run_against_oracle


def test_presets_hold_published_values():
    mis = CorrectionConfig.from_preset("mis")
    assert (mis.is_weight, mis.is_upper, mis.token_mask_low, mis.token_mask_high, mis.seq_veto, mis.batch_normalize) == (
        True, 1.5, 0.5, 1.5, 1e-4, True,
    )
    assert mis.log_ratio_clamp == 20.0 and mis.preset == "mis"
    paper = CorrectionConfig.from_preset("paper")
    assert (paper.is_weight, paper.is_upper, paper.token_mask_low, paper.seq_veto, paper.batch_normalize) == (
        True, None, None, 1e-4, False,
    )
    none = CorrectionConfig.from_preset("none")
    assert not none.is_weight and none.seq_veto is None and none.token_mask_low is None
    assert CorrectionConfig.from_preset("mis", seq_veto=1e-3).seq_veto == 1e-3


@pytest.mark.parametrize(
    "make, flag",
    [
        (lambda: CorrectionConfig.from_preset("nope"), "--correction-preset"),
        (lambda: CorrectionConfig.from_preset("mis", bogus_knob=1), "--correction-bogus-knob"),
        (lambda: CorrectionConfig.from_preset("mis", seq_veto=-1e-4), "--correction-seq-veto"),
        (lambda: CorrectionConfig.from_preset("mis", is_upper=0.0), "--correction-is-upper"),
        (lambda: CorrectionConfig.from_preset("mis", token_mask_low=-0.1), "--correction-token-mask-low"),
        (lambda: CorrectionConfig.from_preset("mis", token_mask_low=1.5), "--correction-token-mask-low"),
        (lambda: CorrectionConfig.from_preset("mis", token_mask_high=float("inf")), "--correction-token-mask-high"),
        (lambda: CorrectionConfig.from_preset("mis", log_ratio_clamp=0.0), "--correction-log-ratio-clamp"),
        (lambda: CorrectionConfig.from_preset("mis", is_weight=False), "--correction-is-upper"),
        (lambda: CorrectionConfig.from_preset("paper", is_weight=False, batch_normalize=True), "--correction-batch-normalize"),
        (lambda: CorrectionConfig(preset="typo").validate(), "--correction-preset"),
    ],
)
def test_validation_names_the_flag(make, flag):
    with pytest.raises(ValueError, match=flag):
        make()



def test_use_tis_is_slimes_vanilla_tis():
    """`--use-tis --tis-clip C --tis-clip-low L` (is_weight, is_upper C, is_lower L) gives slime's vanilla_tis_function
    weights, clamp(exp(logp_old - logp_rollout), min=L, max=C), with nothing rejected."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 9, generator=g) * 3
    sparse = -torch.rand(4, 9, generator=g) * 3
    mask = torch.ones(4, 9)
    mask[1, 6:] = 0
    cfg = CorrectionConfig(is_weight=True, is_upper=2.0, is_lower=0.5)
    res = sparsity_correction(old, sparse, mask, cfg)
    slime = torch.clamp(torch.exp(old - sparse), min=0.5, max=2.0)
    torch.testing.assert_close(res.weights, slime * mask)
    assert torch.equal(res.mask, mask)
    ratio = torch.exp(old - sparse)[mask.bool()]
    assert res.metrics["correction/clip_low_frac"] == pytest.approx(float((ratio < 0.5).float().mean()))
    assert res.metrics["correction/truncate_frac"] == pytest.approx(float((ratio > 2.0).float().mean()))
    assert 0 < res.metrics["correction/clip_low_frac"] < 1 and 0 < res.metrics["correction/truncate_frac"] < 1
    with pytest.raises(ValueError, match="--correction-is-lower=0.5 is invalid: clipping needs --correction-is-weight"):
        CorrectionConfig(is_lower=0.5).validate()


# ------------------------------------------------------------------------------------------------ presets
def verl_config(rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None,
                bypass_mode=False, rollout_is_batch_normalize=False) -> CorrectionConfig:
    """Our knobs for verl's RolloutCorrectionConfig fields (verl HEAD 2026-01, algorithm.py)."""
    icepop = isinstance(rollout_is_threshold, str) and "_" in rollout_is_threshold  # "lower_upper": IcePop
    lower, upper = map(float, rollout_is_threshold.split("_")) if icepop else (0.0, rollout_is_threshold)
    return CorrectionConfig(
        is_weight=rollout_is is not None, is_level=rollout_is or "token",
        is_upper=upper if rollout_is is not None else None, is_lower=lower,
        is_mode="icepop" if icepop else "truncate",
        rs=tuple(rollout_rs.split(",")) if rollout_rs else (),
        rs_threshold=tuple(str(rollout_rs_threshold).split(",")) if rollout_rs else (),
        bypass_mode=bypass_mode, batch_normalize=rollout_is_batch_normalize)


# verl's factory methods at their defaults, transcribed from verl/trainer/config/algorithm.py
VERL_DEFINITIONS = {
    "decoupled_token_is": dict(rollout_is="token"),
    "decoupled_seq_is": dict(rollout_is="sequence"),
    "decoupled_token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_rs="seq_mean_k1",
                                     rollout_rs_threshold="0.999_1.001"),
    "decoupled_k3_rs": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_seq_tis": dict(rollout_is="sequence", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "bypass_ppo_clip": dict(bypass_mode=True),
    "bypass_ppo_clip_geo_rs": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001", bypass_mode=True),
    "bypass_ppo_clip_k3_rs": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01, bypass_mode=True),
}


@pytest.mark.parametrize("name", list(VERL_PRESETS))
def test_verl_presets_equal_their_definitions(name):
    preset = CorrectionConfig.from_preset(name)
    definition = verl_config(**VERL_DEFINITIONS[name])
    assert knobs_of(preset) == knobs_of(definition)
    # the knobs alone name the preset (verl's IcePop factory is our `icepop`: the knobs name ours, the first listed)
    assert definition.preset == {"decoupled_token_icepop": "icepop"}.get(name, name)
    for seed in range(2):  # and it behaves as the oracle reads verl's definition
        run_against_oracle(knobs_of(preset), seed)


def test_preset_list_is_complete():
    assert set(VERL_DEFINITIONS) == set(VERL_PRESETS) and set(PRESETS) == {"none", "paper", "mis", "icepop"}
    help_text = next(f for f in dataclasses.fields(CorrectionConfig) if f.name == "preset").metadata["help"]
    for name in ALL_PRESETS:
        assert name in help_text, name


def test_slime_mis_modes_are_configurations_of_the_algebra():
    """slime's MIS helper (examples/train_infer_mismatch_helper/mis.py): tis_mode truncate / clip / mask at each
    tis_level, rs at each rs_level with the veto, as our knobs; checked by the oracle on every level."""
    for level, (low, up) in (("token", (0.5, 2.0)), ("sequence", (0.5, 2.0)), ("geometric", (0.9999, 1.0001))):
        truncate = dict(is_weight=True, is_level=level, is_upper=up)
        clip = dict(truncate, is_lower=low)
        mask = dict(truncate, is_lower=low, is_mode="mask", seq_veto=1e-4, batch_normalize=level != "geometric")
        for knobs in (truncate, clip, mask):
            run_against_oracle(knobs, 1)


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("knobs, flag", [
    (dict(is_level="tokens"), "--correction-is-level='tokens' is invalid"),
    (dict(is_level="sequence"), "--correction-is-level='sequence' is invalid: a weight level needs"),
    (dict(is_weight=True, is_mode="clip"), "--correction-is-mode='clip' is invalid"),
    (dict(is_weight=True, is_mode="mask"), "mask mode needs --correction-is-weight and --correction-is-upper"),
    (dict(rs=("seq_max_k1",), rs_threshold=("2",)), "--correction-rs='seq_max_k1' is invalid"),
    (dict(rs=("token_k2",)), "--correction-rs-threshold takes one threshold"),
    (dict(rs_threshold=("2",)), "--correction-rs-threshold=2 has no effect without --correction-rs"),
    (dict(rs=("token_k2", "token_k2"), rs_threshold=("2",)), "names an option twice"),
    (dict(rs=("token_k2", "token_k3"), rs_threshold=("2", "3", "4")), "one per option \\(2\\), got 3"),
    (dict(rs=("token_k2",), rs_threshold=("0.5_2",)), "one positive upper bound"),
    (dict(rs=("token_k1",), rs_threshold=("2_0.5",)), "the lower bound must be below"),
    (dict(rs=("token_k1",), rs_threshold=("abc",)), "not a number or lower_upper"),
    (dict(rs=("token_k3",), rs_threshold=("-1",)), "one positive upper bound"),
    (dict(opsm_delta=-1.0), "--correction-opsm-delta=-1.0 is invalid"),
    (dict(bypass_mode=True, is_weight=True), "--correction-bypass-mode=True is invalid: the PPO ratio"),
])
def test_bad_knobs_name_the_flag(knobs, flag):
    with pytest.raises(ValueError, match=flag):
        CorrectionConfig(**knobs).validate()

# ------------------------------------------------------------------------------------------------ old configs
# the correction section as runs saved it before this algebra (config.yaml, and checkpoints' trainer_state.json)
OLD_MIS_SECTION = dict(is_weight=True, is_upper=1.5, is_lower=0.0, token_mask_low=0.5, token_mask_high=1.5,
                       seq_veto=1e-4, batch_normalize=True, log_ratio_clamp=20.0, preset="mis")


def test_a_section_saved_before_the_new_knobs_loads_to_the_same_correction():
    old = CorrectionConfig.from_dict(OLD_MIS_SECTION)
    assert old == CorrectionConfig.from_preset("mis")
    assert (old.is_level, old.is_mode, old.rs, old.opsm_delta, old.bypass_mode) == ("token", "truncate", (), None, False)
    custom = CorrectionConfig.from_dict({**OLD_MIS_SECTION, "is_upper": 2.0, "preset": "custom"})
    assert custom.preset == "custom" and custom.is_upper == 2.0
    tis = CorrectionConfig.from_dict(dict(is_weight=True, is_upper=2.0, preset="custom"))  # an old --use-tis run
    assert tis.preset == "decoupled_token_is"  # its knobs are verl's token TIS, so the label follows them


def test_resuming_a_checkpoint_saved_before_the_new_knobs_sees_no_change(tmp_path):
    """resume.experiment_changes compares a checkpoint's saved config with the current one: a field the older
    version did not have counts as its default, and the preset is a label of the knobs (compared themselves)."""
    import copy

    from slime_sparse.config import RunConfig
    from slime_sparse.resume import checkpoint_config, experiment_changes

    current = checkpoint_config(RunConfig(correction=CorrectionConfig(is_weight=True, is_upper=2.0)))
    saved = copy.deepcopy(current)
    for name in ("is_level", "is_mode", "rs", "rs_threshold", "opsm_delta", "bypass_mode"):
        del saved["correction"][name]
    del saved["log"]["mismatch_metrics_interval"]
    saved["correction"]["preset"] = "custom"  # what --use-tis runs recorded before decoupled_token_is existed
    assert current["correction"]["preset"] == "decoupled_token_is"
    assert experiment_changes(saved, current) == []
    geo = checkpoint_config(RunConfig(correction=CorrectionConfig.from_preset("decoupled_geo_rs")))
    assert experiment_changes(saved, geo) == ["--correction-is-weight True -> False", "--correction-is-upper 2.0 -> unset",
                                              "--correction-rs unset -> seq_mean_k1",
                                              "--correction-rs-threshold unset -> 0.999_1.001"]


def test_yaml_takes_rejection_statistics(tmp_path):
    from slime_sparse.config_loader import load_config

    model = tmp_path / "m"
    model.mkdir()
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("correction:\n  rs: [token_k1, seq_max_k2]\n  rs_threshold: ['0.6_1.4', '2.0']\n"
                         "  opsm_delta: 1e-4\n")
    cfg = load_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--config", str(yaml_file)])
    assert cfg.correction.rs == ("token_k1", "seq_max_k2") and cfg.correction.rs_threshold == ("0.6_1.4", "2.0")
    assert cfg.correction.opsm_delta == 1e-4
    flags = load_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--correction-rs",
                         "token_k1,seq_max_k2", "--correction-rs-threshold", "0.6_1.4", "2.0", "--correction-opsm-delta",
                         "1e-4"])
    assert flags.correction == cfg.correction
