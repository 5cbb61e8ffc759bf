"""Partial rollouts in the embedded engine (--partial-rollout): a call stops once enough groups finished, the rest is
aborted with its eviction record so far, and a later call continues it, replaying the record's compressions in its
prefill.

References: an uninterrupted call of the same prompts and seed (under unchanged weights a continuation must draw the
same tokens, with the same log-probs and the same eviction record), and the learner's shadow forward of the record
(it must reproduce the sampler's log-prob of every token, before and after the break, to 1e-5 in fp32)."""
from __future__ import annotations

import pytest
import torch

from slime_sparse.backends.logprobs import response_logprobs
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.embedded import EmbeddedEngine
from slime_sparse.rollout.partial import PartialSpec
from slime_sparse.rollout import SamplingParams
from tests.helpers.shadow import PROMPTS, shadow_error, tiny_model

# stop ids the tiny random model hits now and then: samples end at different lengths, so a stop rule cuts some mid-way
SAMPLE = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=40, stop_token_ids=[5, 6, 7, 8], ignore_eos=True)

N = 2  # samples per prompt: groups of 2, as GRPO's
GROUPED = [p for p in PROMPTS for _ in range(N)]
GROUPS = tuple(i // N for i in range(len(GROUPED)))
KVS = {
    "rkv-head": KVCompressConfig(method="rkv", budget=12, buffer=5, window=3, kernel_size=3),
    "snapkv-layer": KVCompressConfig(method="snapkv", budget=12, buffer=5, window=3, kernel_size=3,
                                     granularity="layer"),
    "h2o-pyramid": KVCompressConfig(method="h2o", budget=12, buffer=5, window=3, budget_schedule="explicit",
                                    layer_budgets=(16, 8)),
    "dense": KVCompressConfig(method="none"),
}


def engine(model, kv, rows=3):
    return EmbeddedEngine(model, kv, max_batch_size=rows)


def continue_until_done(eng, first, seed=7, rounds=6):
    """Continue the aborted outputs of `first` call after call (each stopping after one more group) until none is
    left; returns the final outputs and how many calls continued something."""
    outs, calls = list(first), 0
    while any(o.finish_reason == "abort" for o in outs) and calls < rounds:
        todo = [i for i, o in enumerate(outs) if o.finish_reason == "abort"]
        groups = tuple(GROUPS[i] for i in todo)
        more = eng.generate([GROUPED[i] for i in todo], SAMPLE, seed=seed + 100 + calls,
                            partial=PartialSpec(groups, 1, tuple(outs[i] for i in todo)))
        for i, o in zip(todo, more):
            outs[i] = o
        calls += 1
    return outs, calls


@pytest.mark.parametrize("name", list(KVS))
def test_a_continued_sample_is_the_uninterrupted_one(name):
    """Stop after one group, continue the rest in later calls (each stopping early again): tokens, log-probs, KV
    accounting and eviction records equal those of one uninterrupted call; the shadow forward reproduces them."""
    model, kv = tiny_model(), KVS[name]
    seed = 8  # streams under which the stop rule cuts samples after their first compression, for every config
    whole = engine(model, kv).generate(GROUPED, SAMPLE, seed=seed)
    eng = engine(model, kv)
    first = eng.generate(GROUPED, SAMPLE, seed=seed, partial=PartialSpec(GROUPS, 1))
    aborted = [o for o in first if o.finish_reason == "abort"]
    assert aborted and any(o.response_ids for o in aborted), "the stop rule cut nothing mid-sample"
    if name != "dense":  # the break falls after compressions: the continuation must replay them
        assert any(o.response_ids for o in aborted if o.kv.compressions), "no aborted sample had compressed yet"
    outs, calls = continue_until_done(eng, first)
    assert calls >= 2 and not any(o.finish_reason == "abort" for o in outs)
    for a, b in zip(outs, whole):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert (a.kv.dense_kv_tokens, a.kv.kept_kv_tokens, a.kv.peak_kv_tokens, a.kv.compressions) == \
            (b.kv.dense_kv_tokens, b.kv.kept_kv_tokens, b.kv.peak_kv_tokens, b.kv.compressions)
        if b.evictions is None:
            assert a.evictions is None
        else:
            assert torch.equal(a.evictions.starts, b.evictions.starts)
            assert torch.equal(a.evictions.keep_bits, b.evictions.keep_bits)
    assert shadow_error(model, outs) <= 1e-5


def test_a_continuation_under_new_weights_is_reproduced_by_the_shadow_forward():
    """Weights change between the break and the continuation (a sync, as between two rollouts): the shadow forward
    under the new weights reproduces every token the continuation sampled, under the old weights every token
    before it: the record says what each token saw across the break."""
    old_model, kv = tiny_model(0), KVS["rkv-head"]
    eng = engine(tiny_model(0), kv)  # a copy: update_weights writes into the engine's model in place
    first = eng.generate(GROUPED, SAMPLE, seed=7, partial=PartialSpec(GROUPS, 1))
    cut = [i for i, o in enumerate(first) if o.finish_reason == "abort" and o.response_ids]
    assert cut
    new_model = tiny_model(1)
    eng.update_weights(new_model.state_dict())
    more = eng.generate([GROUPED[i] for i in cut], SAMPLE, seed=9,
                        partial=PartialSpec(tuple(GROUPS[i] for i in cut), None, tuple(first[i] for i in cut)))
    assert all(o.finish_reason != "abort" for o in more)
    tokens = [o.prompt_ids + o.response_ids for o in more]
    lens = [len(o.response_ids) for o in more]
    with torch.no_grad():
        shadow_new, _ = response_logprobs(new_model, tokens, lens, temperature=SAMPLE.temperature,
                                          shadow=[o.evictions for o in more])
        shadow_old, _ = response_logprobs(old_model, tokens, lens, temperature=SAMPLE.temperature,
                                          shadow=[o.evictions for o in more])
    worst_new = worst_old = 0.0
    for k, (i, o) in enumerate(zip(cut, more)):
        brk = len(first[i].response_ids)
        assert o.response_ids[:brk] == first[i].response_ids  # the continuation starts from the aborted tokens
        lp = torch.tensor(o.logprobs)
        worst_old = max(worst_old, float((shadow_old[k, :brk] - lp[:brk]).abs().max()))
        worst_new = max(worst_new, float((shadow_new[k, brk:lens[k]] - lp[brk:]).abs().max()))
    assert worst_old <= 1e-5 and worst_new <= 1e-5


def test_stop_rule_counts_whole_groups_and_aborts_the_rest():
    model, kv = tiny_model(), KVS["rkv-head"]
    outs = engine(model, kv, rows=8).generate(GROUPED, SAMPLE, seed=7, partial=PartialSpec(GROUPS, 2))
    finished_groups = {g for g in set(GROUPS) if all(outs[i].finish_reason != "abort"
                                                     for i in range(len(GROUPED)) if GROUPS[i] == g)}
    assert len(finished_groups) >= 2 and any(o.finish_reason == "abort" for o in outs)
    assert all(o.stream_key is not None for o in outs)
    full = engine(model, kv, rows=8).generate(GROUPED, SAMPLE, seed=7, partial=PartialSpec(GROUPS, None))
    assert all(o.finish_reason != "abort" for o in full)


def test_bad_continuations_are_refused():
    model, kv = tiny_model(), KVS["rkv-head"]
    eng = engine(model, kv)
    first = eng.generate(GROUPED, SAMPLE, seed=7, partial=PartialSpec(GROUPS, 1))
    done = next(o for o in first if o.finish_reason != "abort")
    with pytest.raises(ValueError, match="not aborted"):
        eng.generate([done.prompt_ids], SAMPLE, partial=PartialSpec((0,), None, (done,)))
    cut = next(o for o in first if o.finish_reason == "abort")
    with pytest.raises(ValueError, match="differs from the prompt"):
        eng.generate([[1, 2, 3]], SAMPLE, partial=PartialSpec((0,), None, (cut,)))
    with pytest.raises(ValueError, match="contiguous"):
        eng.generate([[1], [2], [3]], SAMPLE, partial=PartialSpec((0, 1, 0)))


def test_the_carried_groups_survive_a_checkpoint():
    """PartialBuffer's state (what a checkpoint's data state holds) through JSON: the restored aborted outputs continue
    exactly as the originals would (the same tokens, log-probs and eviction records)."""
    import json
    from types import SimpleNamespace

    import numpy as np

    from slime_sparse.rollout.partial import Member, PartialBuffer, PartialGroup

    prompts = [SimpleNamespace(prompt_ids=p, prompt_text=str(p), label=None, metadata={}, row=i)
               for i, p in enumerate(PROMPTS)]
    stream = SimpleNamespace(dataset=prompts, epoch_order=lambda epoch: np.arange(len(prompts)))
    model, kv = tiny_model(), KVS["rkv-head"]
    eng = engine(model, kv)
    # streams under which samples are aborted after a compression
    first = eng.generate(GROUPED, SAMPLE, seed=8, partial=PartialSpec(GROUPS, 1))
    buffer = PartialBuffer(stream)
    from slime_sparse.rollout.partial import _record_at

    buffer.carry([PartialGroup(_record_at(stream, g), [Member(first[i], [(0, 3)]) for i in range(len(GROUPED))
                                                      if GROUPS[i] == g]) for g in sorted(set(GROUPS))])
    restored = PartialBuffer(stream)
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert restored.state_dict() == buffer.state_dict()
    a = [m.output for g in buffer.groups for m in g.members]
    b = [m.output for g in restored.groups for m in g.members]
    todo = [i for i, o in enumerate(a) if o.finish_reason == "abort"]
    assert todo and any(a[i].evictions is not None for i in todo)
    spec = lambda outs: PartialSpec(tuple(GROUPS[i] for i in todo), None, tuple(outs[i] for i in todo))  # noqa: E731
    x = engine(model, kv).generate([GROUPED[i] for i in todo], SAMPLE, seed=1, partial=spec(a))
    y = engine(model, kv).generate([GROUPED[i] for i in todo], SAMPLE, seed=1, partial=spec(b))
    for p, q in zip(x, y):
        assert p.response_ids == q.response_ids and p.logprobs == q.logprobs
        assert (p.evictions is None) == (q.evictions is None)
        assert p.evictions is None or torch.equal(p.evictions.keep_bits, q.evictions.keep_bits)


def test_a_carried_group_too_old_is_regenerated_not_continued():
    """partial_round under --max-staleness 2 at rollout 4: a group first written at version 1 would train 3 versions
    old, so its prompt is generated anew (fresh samples, no continuation); one written at version 3 is continued."""
    from types import SimpleNamespace

    from slime_sparse.config import RunConfig
    from slime_sparse.rollout.partial import Member, PartialBuffer, PartialGroup, partial_round
    from slime_sparse.types import GenerationOutput

    cfg = RunConfig.from_dict({"rollout": {"n_samples_per_prompt": 2, "rollout_batch_size": 1,
                                           "over_sampling_batch_size": 3},
                               "overlap": {"partial_rollout": True, "max_staleness": 2},
                               "train": {"global_batch_size": 2}})
    record = lambda i: SimpleNamespace(index=i, prompt_ids=[1, 2, i], label=None)  # noqa: E731
    aborted = lambda i: GenerationOutput([1, 2, i], [7], [-0.5], "abort", stream_key=100 + i)  # noqa: E731
    calls = []

    class Engine:
        def generate(self, prompts, params, seed=None, partial=None):
            calls.append(partial)
            return [GenerationOutput(list(p), ([7] if r is None else list(r.response_ids)) + [8], [-0.1, -0.2][:1 + (r
                    is not None)], "stop", stream_key=1) for p, r in zip(prompts, partial.resume)]

    stream = SimpleNamespace(next_batch=lambda n: [record(10 + k) for k in range(n)])
    buffer = PartialBuffer(stream)
    buffer.carry([PartialGroup(record(0), [Member(aborted(0), [(0, 1)]), Member(aborted(0), [(0, 1)])]),
                  PartialGroup(record(1), [Member(aborted(1), [(0, 3)]), Member(aborted(1), [(0, 3)])])])
    source = SimpleNamespace(partial=buffer, policy_version=4, stream=stream, engine=Engine())
    made = partial_round(cfg, source, rollout_id=4, size=3, need=1, seed=0)
    (spec,) = calls
    assert spec.groups == (0, 0, 1, 1, 2, 2) and spec.stop_after_groups == 1
    assert spec.resume[:2] == (None, None)  # too old: drawn anew
    assert all(r is not None for r in spec.resume[2:4]) and spec.resume[4:] == (None, None)
    assert made.metrics["rollout/partial_regenerated"] == 1 and made.metrics["rollout/partial_continued"] == 2
    segments = {g.record.index: [m.segments for m in g.members] for g in made.complete}
    assert segments[0] == [[(0, 4)]] * 2 and segments[1] == [[(0, 3), (1, 4)]] * 2
