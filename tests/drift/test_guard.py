"""The drift guard's plumbing (#44), never the science's outcome: its statistics against independent formulas, the
alarm on a constructed gap and its silence on noise, both arms drawing from the same random streams (embedded and
SGLang engines), probe prompts that are never training prompts, a run whose training numbers are the same with the
guard on or off, and a resume that keeps the budget the guard moved."""
from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from slime_sparse.config_loader import parse_config
from slime_sparse.drift import guard as guard_mod
from slime_sparse.drift.budget import AdaptiveBudget, KVLedger, ladder
from slime_sparse.drift.guard import DENSE, DriftGuard, build_guard
from slime_sparse.drift.stats import (ALARM_Z, Arm, Streak, clustered_mean, compressed_after, probe_metrics,
                                      significance)
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.sampling import derive_seed
from slime_sparse.train import main
from slime_sparse.types import GenerationOutput, KVStats
from tests.helpers.tiny_runs import read_metrics, rollout_rows
from tests.helpers.tiny_runs import run_args as args


# ---- statistics ----

def test_clustered_mean_is_the_mean_of_prompt_means_with_their_standard_error():
    values = [1.0, 0.0, 0.5, 0.5, 0.2, 0.4, 0.9, 0.1, 0.0]
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    means = [statistics.fmean(values[i:i + 3]) for i in (0, 3, 6)]
    mean, se = clustered_mean(values, groups)
    assert mean == pytest.approx(statistics.fmean(means))
    assert se == pytest.approx(statistics.stdev(means) / math.sqrt(3))
    assert math.isnan(clustered_mean([1.0, 2.0], [0, 0])[1])  # one prompt: no spread to measure


def test_significance_needs_alarm_z_standard_errors():
    assert significance(0.1, 0.1 / (ALARM_Z + 0.01)) == 1
    assert significance(-0.1, 0.1 / (ALARM_Z + 0.01)) == -1
    assert significance(0.1, 0.1 / (ALARM_Z - 0.01)) == 0
    assert significance(0.0, 0.0) == 0 and significance(0.2, 0.0) == 1 and significance(0.2, math.nan) == 0


def test_compressed_after_counts_tokens_sampled_from_a_compressed_cache():
    # prompt of 10 tokens: response token j is sampled by position 9 + j; a compression starting at 20 is seen
    # from position 20 on, i.e. from j = 11
    assert compressed_after(10, 30, 20) == 30 - 11
    assert compressed_after(10, 5, 20) == 0 and compressed_after(10, 30, None) == 0
    assert compressed_after(10, 30, 3) == 30  # cut right after prefill: every token


def arm(rewards, groups, responses=None, compressed=None):
    n = len(rewards)
    return Arm(rewards=rewards, lengths=[len(r) for r in responses] if responses else [1] * n,
               responses=responses or [[int(r * 10)] for r in rewards], groups=groups,
               compressed_tokens=compressed if compressed is not None else [0] * n)


def test_probe_metrics_against_hand_counts():
    groups = [0, 0, 1, 1]
    dense = arm([1.0, 1.0, 0.4, 0.0], groups, responses=[[1, 2], [1, 2], [3], [4, 4, 4, 4]])
    comp = arm([1.0, 0.0, 0.4, 0.4], groups, responses=[[1, 2], [1, 3], [3], [4, 5]], compressed=[0, 1, 0, None])
    m = probe_metrics(dense, comp)
    assert m["drift/reward_gap"] == pytest.approx(statistics.fmean([0.5, -0.2]))
    assert m["drift/reward_dense"] == pytest.approx(0.6) and m["drift/reward_compressed"] == pytest.approx(0.45)
    assert m["drift/length_ratio"] == pytest.approx((7 / 4) / (9 / 4))
    assert m["drift/compressed_frac"] == pytest.approx(1 / 5)  # the unknown sample left out: 1 of 2 + 2 + 1 tokens
    assert m["drift/answer_agreement"] == pytest.approx(2 / 4) and m["drift/reward_agreement"] == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="same prompts"):
        probe_metrics(dense, arm([1.0] * 4, [0, 1, 0, 1]))


def test_an_alarm_takes_two_significant_probes_of_one_sign():
    s = Streak()
    assert [s.update(x) for x in (1, 0, 1, -1, -1)] == [1, 0, 1, 1, 2]
    assert s.alarmed


def test_the_ladder_doubles_to_the_max_or_to_dense():
    assert ladder(87, None, 454 - 16) == [87, 174, 348, None]
    assert ladder(16, 100, 1000) == [16, 32, 64, 100]
    assert ladder(16, 64, 1000) == [16, 32, 64]
    with pytest.raises(ValueError, match="--kv-budget-max"):
        ladder(16, 16, 1000)


def test_the_budget_rises_on_an_alarm_and_falls_when_the_rung_below_shows_no_gap():
    b = AdaptiveBudget([16, 32, None])
    assert b.observe(1, 1, None) is None and b.budget == 16
    move = b.observe(11, 1, None, {"reward_gap": 0.2})
    assert move["from"] == "16" and move["to"] == "32" and move["reward_gap"] == 0.2 and b.budget == 32
    assert b.observe(21, 0, 1) is None  # the rung below still shows a gap: stay
    assert b.observe(31, 0, 0) is None and b.budget == 32  # one quiet probe below is not enough
    assert b.observe(41, 0, 0)["to"] == "16" and b.budget == 16
    state = json.loads(json.dumps(b.state_dict()))
    c = AdaptiveBudget([16, 32, None])
    c.load_state_dict(state)
    assert c.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="ladder"):
        AdaptiveBudget([16, 64, None]).load_state_dict(state)


def test_the_kv_ledger_is_one_minus_kept_over_dense_over_the_run():
    ledger = KVLedger()
    ledger.add(50, 100)
    ledger.add(100, 100)  # a dense rollout saves nothing
    assert ledger.savings == pytest.approx(1 - 150 / 200)


# ---- the guard over a fake engine: an alarm on a constructed gap, none on noise ----

class CoinEngine:
    """Answers [1] (right) or [0] per sample from its random stream (seed, index_offset + i): dense right with
    probability `p_dense`, compressed `p_comp`; `scramble`: the compressed arm draws from another stream (noise that
    pairing cannot cancel). Records every call."""

    def __init__(self, p_dense: float, p_comp: float, scramble: bool = False):
        self.p_dense, self.p_comp, self.scramble = p_dense, p_comp, scramble
        self.calls = []

    def generate(self, prompts, params, seed=None, index_offset=0, *, kv=None):
        self.calls.append({"seed": seed, "index_offset": index_offset, "kv": kv, "n": len(prompts),
                           "budget": kv.budget if kv is not None and kv.enabled else None})
        out = []
        for i, prompt in enumerate(prompts):
            dense = kv is None or not kv.enabled
            u = random.Random(derive_seed(seed, index_offset + i) + (0 if dense or not self.scramble else 7)).random()
            right = u < (self.p_dense if dense else self.p_comp)
            out.append(GenerationOutput(prompt_ids=list(prompt), response_ids=[int(right)], logprobs=[0.0],
                                        finish_reason="stop", kv=KVStats(dense_kv_tokens=1, kept_kv_tokens=1)))
        return out


def coin_components(engine, n_prompts=16):
    records = [SimpleNamespace(index=i, prompt_ids=[100 + i], label="1") for i in range(n_prompts)]
    tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens=True: [str(x[0]) for x in ids])
    reward_fn = lambda texts, labels, extras: ([float(t == lab) for t, lab in zip(texts, labels)], {})  # noqa: E731
    return SimpleNamespace(engine=engine, tokenizer=tokenizer, reward_fn=reward_fn), records


def coin_cfg(*flags):
    return parse_config(["--kv-method", "rkv", "--kv-budget", "16", "--kv-buffer", "8", "--n-samples-per-prompt", "4",
                         "--eval-prompt-data", "unused.jsonl", *flags])[0]


def test_a_constructed_gap_fires_the_alarm_at_the_second_probe_once(capsys):
    engine = CoinEngine(p_dense=0.8, p_comp=0.3)
    components, records = coin_components(engine)
    guard = DriftGuard(coin_cfg(), records, longest_sequence=200)
    alarms = [guard.probe(components, r)["drift/alarm"] for r in (0, 10, 20)]
    assert alarms == [0.0, 1.0, 1.0] and guard.first_alarm == 11
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "rollout 11" in warnings[0] and "raise --kv-budget (now 16)" in warnings[0]
    assert "--kv-budget-schedule drift" in warnings[0]


def test_the_adaptive_budget_climbs_on_a_gap_and_warns_only_at_its_top(capsys):
    engine = CoinEngine(p_dense=0.8, p_comp=0.3)  # every compressed budget loses reward
    components, records = coin_components(engine)
    guard = DriftGuard(coin_cfg("--kv-budget-schedule", "drift", "--kv-budget-max", "64"), records, 200)
    budgets = []
    for r in range(0, 60, 10):
        guard.probe(components, r)
        budgets.append(guard.current_kv.budget)
    assert budgets == [16, 32, 32, 64, 64, 64]
    assert {c["budget"] for c in engine.calls if c["kv"].enabled} == {16, 32, 64}  # the rung below is probed too
    err = capsys.readouterr().err
    assert "drift guard: rollout 11: --kv-budget 16 -> 32" in err and "rollout 31: --kv-budget 32 -> 64" in err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "rollout 51" in warnings[0] and "raise --kv-budget-max (now 64)" in warnings[0]


def test_noise_between_the_arms_raises_no_alarm(capsys):
    engine = CoinEngine(p_dense=0.5, p_comp=0.5, scramble=True)
    components, records = coin_components(engine)
    guard = DriftGuard(coin_cfg(), records, longest_sequence=200)
    probes = [guard.probe(components, r) for r in range(0, 400, 10)]
    assert max(abs(p["drift/reward_gap"]) for p in probes) > 0.05  # the arms do differ, by noise
    assert sum(p["drift/alarm"] for p in probes) == 0 and guard.first_alarm is None
    assert "warning:" not in capsys.readouterr().err


def test_both_arms_draw_from_the_same_streams_and_the_probe_from_its_own():
    engine = CoinEngine(p_dense=0.8, p_comp=0.3)
    components, records = coin_components(engine)
    guard = DriftGuard(coin_cfg("--seed", "3"), records, longest_sequence=200)
    guard.probe(components, 20)
    dense_call, comp_call = engine.calls
    assert dense_call["seed"] == comp_call["seed"] and dense_call["index_offset"] == comp_call["index_offset"] == 0
    assert not dense_call["kv"].enabled and comp_call["kv"].budget == 16 and dense_call["n"] == 16 * 4
    rollout_seeds = {3 * 1_000_003 + 20} | {derive_seed(3 * 1_000_003 + 20, -r) for r in range(1, 11)}
    assert dense_call["seed"] not in rollout_seeds  # the rollout's rounds draw elsewhere


def test_the_sglang_dense_arm_is_a_per_request_opt_out_with_the_same_seeds():
    from tests.helpers.sglang_fakes import FakeSGLang

    from sglang_patches.settings import DENSE_REQUEST_PARAM
    from slime_sparse.rollout.sglang import SGLangRolloutEngine

    kv = KVCompressConfig(method="rkv", budget=6, buffer=2, window=2, granularity="model")
    with FakeSGLang() as fake:
        engine = SGLangRolloutEngine([fake.url], kv, timeout_s=10)
        components, records = coin_components(engine, n_prompts=2)
        cfg = coin_cfg("--kv-budget", "6", "--kv-buffer", "2", "--kv-window", "2", "--kv-granularity", "model",
                       "--rollout-max-response-len", "4", "--rollout-engine", "sglang")
        DriftGuard(cfg, records, longest_sequence=20).probe(components, 0)
        sent = [r for r in fake.requests if r["path"] == "/generate"]
    dense = [r for r in sent if (r["sampling_params"].get("custom_params") or {}).get(DENSE_REQUEST_PARAM)]
    comp = [r for r in sent if "custom_params" not in r["sampling_params"]]
    assert len(dense) == len(comp) == 2 * 4
    seeds = lambda rs: sorted((tuple(r["input_ids"]), r["sampling_params"]["sampling_seed"]) for r in rs)  # noqa
    assert seeds(dense) == seeds(comp)


# ---- the guard in training runs (the embedded engine, tiny assets) ----

@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=64)


def guarded(assets, run_dir, n, *extra):
    return args(assets, run_dir, n, "--eval-prompt-data", str(assets.test_path), "--drift-probe-interval", "1",
                *extra)


def test_the_embedded_arms_share_streams_up_to_the_first_compression(assets):
    from slime_sparse.factory import EngineSpec, build_engine

    cfg = parse_config(guarded(assets, "unused", 1))[0]
    cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, ignore_eos=True))
    engine = build_engine(EngineSpec.from_run(cfg))
    records = [SimpleNamespace(index=i, prompt_ids=[5 + i, 6, 7, 8, 9], label="0") for i in range(3)]
    guard = DriftGuard(cfg, records, longest_sequence=40)
    seed = 1234
    prompts = [r.prompt_ids for r in records for _ in range(4)]
    out_dense = engine.generate(prompts, cfg.sampling, seed=seed, kv=DENSE)
    out_comp = engine.generate(prompts, cfg.sampling, seed=seed, kv=cfg.kv)
    out_wide = engine.generate(prompts, cfg.sampling, seed=seed, kv=guard.kv_for(1000))  # never compresses
    assert [o.response_ids for o in out_wide] == [o.response_ids for o in out_dense]
    assert any(o.evictions is not None for o in out_comp)
    for d, c in zip(out_dense, out_comp):
        start = int(c.evictions.starts[0]) if c.evictions is not None else None
        same = len(c.response_ids) - compressed_after(len(c.prompt_ids), len(c.response_ids), start)
        assert d.response_ids[:same] == c.response_ids[:same]  # the same draws until the cache first compresses


def test_probe_prompts_are_never_training_prompts(assets, tmp_path, capsys):
    train = [json.loads(line) for line in assets.train_path.read_text().splitlines()]
    test = [json.loads(line) for line in assets.test_path.read_text().splitlines()]
    mixed = tmp_path / "probe.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in train[:3] + test))
    cfg = parse_config(guarded(assets, tmp_path / "r", 1, "--drift-probe-data", str(mixed)))[0]
    from slime_sparse.components import build_components

    components = build_components(cfg)
    try:
        guard = build_guard(cfg, components)
    finally:
        components.close()
    training = {tuple(p.prompt_ids) for p in components.stream.dataset.prompts}
    assert len(guard.records) == len(test) and not any(tuple(r.prompt_ids) in training for r in guard.records)
    assert "3 prompts of --drift-probe-data are also training prompts" in capsys.readouterr().err


def final_weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"rollout_{step:06d}" / "model" / "model.safetensors"))


def test_the_guard_leaves_training_as_it_was(assets, tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    assert main(guarded(assets, on, 3)) == 0
    assert main(guarded(assets, off, 3, "--drift-probe-interval", "0")) == 0
    rows_on, rows_off = rollout_rows(on), rollout_rows(off)
    assert all("drift/reward_gap" in r for r in rows_on) and not any("drift/reward_gap" in r for r in rows_off)
    strip = lambda r: {k: v for k, v in r.items()  # noqa: E731
                       if not k.startswith(("drift/", "perf/")) and k not in ("time", "rollout/weight_version")}
    assert [strip(r) for r in rows_on] == [strip(r) for r in rows_off]
    a, b = final_weights(on, 3), final_weights(off, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_guard_is_off_without_held_out_prompts_and_says_so(assets, tmp_path, capsys):
    assert main(args(assets, tmp_path / "r", 1)) == 0  # no --eval-prompt-data
    err = capsys.readouterr().err
    assert "warning: no held-out prompts (--eval-prompt-data or --drift-probe-data): the drift guard is off" in err
    assert not any("drift/reward_gap" in r for r in read_metrics(tmp_path / "r"))


def test_a_resumed_run_keeps_the_budget_the_guard_moved(assets, tmp_path, monkeypatch):
    monkeypatch.setattr(guard_mod, "significance", lambda gap, se: 1)  # every probe sees a gap: raise at the 2nd
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    adaptive = ("--kv-budget-schedule", "drift")
    assert main(guarded(assets, straight, 4, *adaptive)) == 0
    assert main(guarded(assets, resumed, 2, *adaptive)) == 0
    state = json.loads((resumed / "checkpoints" / "rollout_000002" / "trainer_state.json").read_text())
    assert state["extra"]["drift"]["adaptive"]["level"] == 1  # raised before rollout 2: dense (16 -> dense)
    assert main(guarded(assets, resumed, 4, *adaptive)) == 0
    rows_a, rows_b = rollout_rows(straight), rollout_rows(resumed)
    assert [r["drift/kv_budget"] for r in rows_a] == [16.0, 0.0, 0.0, 0.0] == [r["drift/kv_budget"] for r in rows_b]
    assert rows_a[0]["kv/peak_tokens_max"] <= 16 + 4 < rows_a[1]["kv/peak_tokens_max"]  # rollouts ran dense after
    assert rows_a[-1]["kv/savings"] == 0.0 and 0 < rows_a[-1]["drift/run_kv_savings"] < rows_a[0]["kv/savings"]
    for key in ("drift/run_kv_savings", "rollout/reward_mean", "drift/reward_gap"):
        assert [r.get(key) for r in rows_a] == [r.get(key) for r in rows_b], key
    a, b = final_weights(straight, 4), final_weights(resumed, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((resumed / "summary.json").read_text())["drift"]
    assert [(c["rollout"], c["from"], c["to"]) for c in summary["changes"]] == [(2, "16", "dense")]


def test_the_adaptive_budget_needs_its_probes():
    base = ["--kv-method", "rkv", "--kv-budget-schedule", "drift"]
    with pytest.raises(ValueError, match="--drift-probe-data or --eval-prompt-data"):
        parse_config(base)
    with pytest.raises(ValueError, match="--drift-probe-interval must be > 0"):
        parse_config(base + ["--eval-prompt-data", "t.jsonl", "--drift-probe-interval", "0"])
    with pytest.raises(ValueError, match="--kv-budget-max=100 needs --kv-budget-schedule drift"):
        parse_config(["--kv-method", "rkv", "--kv-budget-max", "100"])
    with pytest.raises(ValueError, match="leave --kv-budget-max unset"):
        parse_config(base + ["--eval-prompt-data", "t.jsonl", "--kv-budget-max", "1024", "--rollout-engine", "sglang",
                             "--kv-granularity", "model"])


def test_under_async_the_guard_probes_at_the_weight_updates(assets, tmp_path):
    """--async: the probe needs idle engines, so a due probe waits for the next weight update (every 2 rollouts here)
    and the rollouts between carry no drift/* probe metrics; the run's KV ledger is kept every rollout."""
    run = tmp_path / "run"
    assert main(guarded(assets, run, 4, "--async", "--rm-num-workers", "1", "--update-weights-interval", "2",
                        "--drift-probe-interval", "1")) == 0
    rows = rollout_rows(run)
    assert [("drift/reward_gap" in r) for r in rows] == [False, True, False, True]  # at steps 2 and 4, the updates
    assert all("drift/run_kv_savings" in r for r in rows)
