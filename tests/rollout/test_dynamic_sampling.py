"""Dynamic sampling (slime's --over-sampling-batch-size / --dynamic-sampling-filter-path): the filters, the
selection of a round's groups, the prompt stream's put-back, the flags, and whole runs (full batches, counts,
the bound, exact resume)."""
import json
import math

import pytest
import torch

from slime_sparse.config import RunConfig
from slime_sparse.config_loader import load_config
from slime_sparse.rollout.pipeline import split_steps
from slime_sparse.backends.base import TrainBatch
from slime_sparse.rollout import filter_hub
from slime_sparse.rollout.filter_hub import (DynamicFilterOutput, check_min_kept_samples, check_reward_nonzero_std,
                                             load_filters, round_size, select_groups)
from slime_sparse.train import main
from slime_sparse.types import Sample
from slime_sparse.rollout.base_types import RolloutPlan
from tests.helpers.tiny_runs import read_metrics, rollout_rows
from tests.helpers.tiny_runs import run_args as args


class _Cfg:  # what the built-in filters read of the run config
    class rollout:
        dynamic_sampling_min_kept_samples = 2


def group(index, rewards, rejected=()):
    return [Sample(prompt_index=index, prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop",
                   reward=r, rejected=j in rejected) for j, r in enumerate(rewards)]


# a fixed round of 6 groups of 4 and what a person counts by hand under both built-in filters (min kept 2)
ROUND = [
    group(0, [1, 0, 0, 1]),                   # kept
    group(1, [0, 0, 0, 0]),                   # zero std (0.0)
    group(2, [1, 1, 1, 1]),                   # zero std (1.0)
    group(3, [1, 0, 1, 0], rejected={0, 1, 2}),  # only 1 sample kept by the correction
    group(4, [0, 1, 0, 0], rejected={3}),     # kept
    group(5, [0, 1, 1, 1]),                   # kept, but not needed when 2 are asked for
]
FILTERS = [check_reward_nonzero_std, check_min_kept_samples]


def test_selection_counts_equal_a_hand_count():
    sel = select_groups(ROUND, FILTERS, _Cfg, need=2)
    assert sel.kept == [0, 4]
    assert sel.judged == 5  # group 5 was not needed: it goes back to the stream
    assert dict(sel.dropped) == {"zero_std_0.0": 1, "zero_std_1.0": 1, "few_kept": 1}

    everything = select_groups(ROUND, FILTERS, _Cfg, need=6)  # the round cannot fill 6: all judged
    assert everything.kept == [0, 4, 5] and everything.judged == 6 and sum(everything.dropped.values()) == 3
    assert select_groups(ROUND, [], _Cfg, need=2).kept == [0, 1]  # no filter: the first groups


def test_fallback_keeps_a_flat_group_only_when_the_round_cannot_fill_the_batch():
    fallback = [filter_hub.check_reward_nonzero_std_with_fallback]
    # need 3 of 3 groups with one flat: it must be kept (dropping it leaves too few candidates), as in slime
    sel = select_groups([group(0, [1, 1]), group(1, [0, 1]), group(2, [1, 0])], fallback, _Cfg, need=3)
    assert sel.kept == [0, 1, 2] and not sel.dropped
    # need 2 of 3: the flat group is dropped, the others fill the batch
    sel = select_groups([group(0, [1, 1]), group(1, [0, 1]), group(2, [1, 0])], fallback, _Cfg, need=2)
    assert sel.kept == [1, 2] and dict(sel.dropped) == {"zero_std_1.0": 1}


def test_later_rounds_draw_what_is_needed_at_the_pass_rate_so_far():
    assert round_size(24, need=16, kept=0, judged=0) == 24  # the first round: --over-sampling-batch-size
    assert round_size(24, need=5, kept=11, judged=16) == 8  # ceil(5 * 16 / 11)
    assert round_size(24, need=5, kept=16, judged=16) == 5  # everything passed so far: what is still needed
    assert round_size(24, need=10, kept=1, judged=16) == 24  # a low rate: at most --over-sampling-batch-size
    assert round_size(24, need=16, kept=0, judged=16) == 24  # nothing passed yet


def test_filters_load_by_slime_path_bare_name_and_module_path():
    slime = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
    assert load_filters([slime, "check_min_kept_samples"]) == [check_reward_nonzero_std, check_min_kept_samples]
    assert load_filters(["slime_sparse.rollout.filter_hub:check_reward_nonzero_std",
                         "slime_sparse.rollout.filter_hub.check_min_kept_samples"]) == FILTERS
    with pytest.raises(ValueError, match="--dynamic-sampling-filter-path 'no_such_module.f'"):
        load_filters(["no_such_module.f"])
    with pytest.raises(ValueError, match="has no function"):
        load_filters(["slime_sparse.rollout.filter_hub:nope"])
    assert filter_hub.judge([lambda cfg, s: False], _Cfg, ROUND[0]) == DynamicFilterOutput(keep=False)


def test_split_steps_of_a_short_batch_uses_every_sample():
    n = 7  # e.g. 7 samples kept where 8 were asked for, 4 optimizer steps
    batch = TrainBatch(tokens=[[1, 2]] * n, response_lens=[1] * n, advantages=torch.arange(n, dtype=torch.float32),
                       loss_masks=[torch.ones(1)] * n, old_logprobs=[torch.zeros(1)] * n)
    parts = split_steps(batch, 4)
    assert [len(p) for p in parts] == [2, 2, 2, 1]
    assert torch.cat([p.advantages for p in parts]).tolist() == list(range(n))
    assert [p.num_seqs for p in parts] == [2, 2, 2, 1]
    assert [len(p) for p in split_steps(batch.select([0, 1]), 4)] == [1, 1]  # no empty step


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=64)


def test_flags_parse_in_slime_spelling(assets, tmp_path):
    cfg = load_config(args(assets, tmp_path, 1, "--over-sampling-batch-size", "4", "--dynamic-sampling-filter-path",
                           "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
                           "check_min_kept_samples", "--dynamic-sampling-min-kept-samples", "2",
                           "--dynamic-sampling-max-rounds", "3"))
    r = cfg.rollout
    assert (r.over_sampling_batch_size, r.sampling_batch_size, r.dynamic_sampling_min_kept_samples,
            r.dynamic_sampling_max_rounds) == (4, 4, 2, 3)
    assert r.dynamic_sampling_filter_path == (
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std", "check_min_kept_samples")
    assert load_config(args(assets, tmp_path, 1)).rollout.sampling_batch_size == 2  # slime: --rollout-batch-size
    yaml_cfg = RunConfig.from_dict({"rollout": {"dynamic_sampling_filter_path": "check_min_kept_samples"}})  # YAML
    assert yaml_cfg.rollout.dynamic_sampling_filter_path == ("check_min_kept_samples",)
    for bad, flag in ((["--over-sampling-batch-size", "1"], "--over-sampling-batch-size=1 must be >="),
                      (["--dynamic-sampling-filter-path", "nowhere.f"], "--dynamic-sampling-filter-path"),
                      (["--dynamic-sampling-min-kept-samples", "5"], "--dynamic-sampling-min-kept-samples=5"),
                      (["--dynamic-sampling-max-rounds", "0"], "--dynamic-sampling-max-rounds=0")):
        with pytest.raises(ValueError, match=flag):
            load_config(args(assets, tmp_path, 1, *bad))


DS = ("--over-sampling-batch-size", "4", "--dynamic-sampling-filter-path", "tests.helpers.tiny_runs:keep_even_positions")


def data_state(run_dir, step):
    path = run_dir / "checkpoints" / f"rollout_{step:06d}" / "trainer_state.json"
    return json.loads(path.read_text())["data_state"]


def test_filtered_run_trains_on_full_batches_with_hand_counted_metrics(assets, tmp_path):
    run = tmp_path / "run"
    assert main(args(assets, run, 2, *DS)) == 0
    rows = rollout_rows(run)
    # rollout 1 draws positions 0-3: 0 kept, 1 dropped, 2 kept (batch full), 3 put back;
    # rollout 2 draws 3-6: 3 dropped, 4 kept, 5 dropped, 6 kept
    hand = [dict(generated=4, kept=2, dropped=1, put_back=1, consumed=3),
            dict(generated=4, kept=2, dropped=2, put_back=0, consumed=7)]
    for step, (row, h) in enumerate(zip(rows, hand), start=1):
        assert row["rollout/groups_generated"] == h["generated"] and row["rollout/groups_kept"] == h["kept"]
        assert row["rollout/groups_dropped"] == row["rollout/dynamic_filter/drop_odd"] == h["dropped"]
        assert row["rollout/groups_put_back"] == h["put_back"] and row["rollout/gen_rounds"] == 1
        assert row["rollout/dynamic_sampling_exhausted"] == 0
        assert row["correction/seqs"] == 2 * 4  # a full batch: --rollout-batch-size 2 x 4 samples
        assert data_state(run, step)["consumed"] == h["consumed"]
        # every generated sample's tokens counted: 16 samples at the logged mean length
        assert math.isclose(row["rollout/gen_tokens"], 16 * row["rollout/response_len_mean"])
        assert row["rollout/gen_tokens_per_train_token"] > 1.0
        assert 0 <= row["rollout/effective_batch_size"] <= 8


def test_a_second_round_fills_the_batch(assets, tmp_path):
    run = tmp_path / "run"
    assert main(args(assets, run, 2, "--over-sampling-batch-size", "3",
                     "--dynamic-sampling-filter-path", "tests.helpers.tiny_runs:keep_every_third")) == 0
    # rollout 1: round 1 draws 0-2 (0 kept, 1 and 2 dropped); at a pass rate of 1/3 round 2 draws 3 prompts, 3-5:
    # 3 kept (batch full), 4 and 5 put back. Rollout 2: 4, 5 dropped, 6 kept; then 7, 8 dropped, 9 kept
    hand = [dict(generated=6, dropped=2, put_back=2, consumed=4), dict(generated=6, dropped=4, put_back=0, consumed=10)]
    for step, (row, h) in enumerate(zip(rollout_rows(run), hand), start=1):
        assert (row["rollout/gen_rounds"], row["rollout/groups_kept"], row["correction/seqs"]) == (2, 2, 8)
        assert row["rollout/groups_generated"] == h["generated"] and row["rollout/groups_dropped"] == h["dropped"]
        assert row["rollout/groups_put_back"] == h["put_back"] and row["rollout/dynamic_filter/drop_filtered"] == h["dropped"]
        assert data_state(run, step)["consumed"] == h["consumed"]


def test_bound_on_rounds_trains_on_what_it_kept_and_says_so(assets, tmp_path, caplog):
    run = tmp_path / "run"
    extra = ("--over-sampling-batch-size", "2", "--dynamic-sampling-filter-path", "tests.helpers.tiny_runs:keep_every_third",
             "--dynamic-sampling-max-rounds", "1")
    with caplog.at_level("WARNING", logger="slime_sparse.train"):
        assert main(args(assets, run, 2, *extra)) == 0
    rows = rollout_rows(run)
    # rollout 1: positions 0 (kept), 1 (dropped); rollout 2: 2 (dropped), 3 (kept): one group of two each time
    for row in rows:
        assert (row["rollout/groups_kept"], row["rollout/groups_dropped"], row["rollout/gen_rounds"]) == (1, 1, 1)
        assert row["rollout/dynamic_sampling_exhausted"] == 1
        assert row["correction/seqs"] == 4  # trained on the one group it kept
        assert "train/loss" in row
    assert "kept 1 of --rollout-batch-size=2 groups" in caplog.text


def test_a_rollout_that_keeps_nothing_takes_no_optimizer_step(assets, tmp_path):
    run = tmp_path / "run"
    extra = ("--dynamic-sampling-filter-path", "slime_sparse.rollout.filter_hub:check_min_kept_samples",
             "--dynamic-sampling-min-kept-samples", "4", "--correction-seq-veto", "1e9",  # every sequence vetoed
             "--dynamic-sampling-max-rounds", "2")
    assert main(args(assets, run, 1, *extra)) == 0
    (row,) = rollout_rows(run)
    assert (row["rollout/groups_generated"], row["rollout/groups_kept"], row["rollout/gen_rounds"]) == (4, 0, 2)
    assert row["rollout/dynamic_filter/drop_few_kept"] == 4 and row["rollout/dynamic_sampling_exhausted"] == 1
    assert "train/loss" not in row and "correction/seqs" not in row
    assert data_state(run, 1)["consumed"] == 4  # the dropped prompts are used up, not handed out again


def test_resume_is_exact_with_over_sampling(assets, tmp_path):
    from tests.e2e.test_train import final_weights

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args(assets, straight, 4, *DS)) == 0
    assert main(args(assets, resumed, 2, *DS)) == 0  # "killed" after rollout 2
    assert main(args(assets, resumed, 4, *DS)) == 0  # the same command, longer: resumes at rollout 2
    a, b = final_weights(straight, 4), final_weights(resumed, 4)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert data_state(straight, 4) == data_state(resumed, 4)
    assert data_state(straight, 4)["consumed"] == 15  # 4 rollouts x 2 kept even positions, position 15 put back
    keys = ("rollout/reward_mean", "rollout/groups_dropped", "rollout/groups_put_back", "rollout/gen_tokens")
    assert [[r[k] for k in keys] for r in rollout_rows(straight)] == [[r[k] for k in keys] for r in rollout_rows(resumed)]
    assert [r["step"] for r in read_metrics(resumed) if "rollout/groups_kept" in r] == [1, 2, 3, 4]


def test_put_back_returns_the_last_prompts_in_order(tmp_path):
    from slime_sparse.data.prompt_dataset import DataConfig, PromptDataset, PromptStream

    class Tok:
        def __call__(self, text, **kw):
            return {"input_ids": [len(text)]}

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * (i + 1), "label": i}) + "\n" for i in range(5)))
    stream = PromptStream(PromptDataset(DataConfig(prompt_data=str(data), shuffle=False), Tok()), 2)
    first = stream.next_batch(4)
    stream.put_back(1)
    again = stream.next_batch()
    assert [r.index for r in first] == [0, 1, 2, 3] and [r.index for r in again] == [3, 4]
    assert again[0] == first[3]
    with pytest.raises(ValueError, match="cannot put back 7"):
        stream.put_back(7)


class _FixedLearner:  # dense pi_old far below the sampler's log-probs: the mis veto rejects the first sequence
    def compute_logprobs(self, tokens, response_lens):
        return [torch.full((n,), -20.0 if i == 0 else 0.0) for i, n in enumerate(response_lens)]


@pytest.mark.parametrize("loss_type, rejected", [("sparse_rl", [True, False]), ("shadow", [False, False]),
                                                 ("smd", [False, False])])
def test_only_sparse_rl_marks_samples_rejected(loss_type, rejected):
    from slime_sparse.algo import CorrectionConfig, LossConfig
    from slime_sparse.rollout.pipeline import correct

    samples = group(0, [1, 0])
    trains_shadow = LossConfig(loss_type=loss_type).trains_shadow
    correct(samples, _FixedLearner(), CorrectionConfig.from_preset("mis"), plan=RolloutPlan(trains_shadow=trains_shadow))
    assert [s.rejected for s in samples] == rejected  # shadow / smd train the sampler's policy: nothing rejected
