"""Warnings about a run that cannot learn or cannot compress: each one line on stderr, starting with `warning:` and
naming the flag to change.

They warn rather than refuse because each setting has a legitimate use (a dense baseline with a method's name
in its config, a greedy smoke test), but a user who did not mean it would otherwise lose a whole run finding out.
`start_warnings` are known once the data is loaded, before the first rollout; `no_gradient_warning` after a
rollout whose groups all had equal rewards (the loop shows it once per run).
"""
from __future__ import annotations

import sys

from slime_sparse.config import RunConfig
from slime_sparse.flags import flag_for
from slime_sparse.kv.schedule import never_compresses, trigger

ZERO_STD_FRAC = "adv/zero_std_frac"  # the metric the no-gradient warning reads (algo/advantages.py)


def warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def start_warnings(cfg: RunConfig, longest_prompt: int) -> list[str]:
    """The warnings of a run's settings; `longest_prompt`: the longest prompt it can see, in tokens."""
    out = []
    kv, max_new = cfg.kv, cfg.sampling.max_new_tokens
    if never_compresses(kv, longest_prompt, max_new):
        prompt_flag = flag_for("data", "max_prompt_len")
        prompt = (f"{prompt_flag} {cfg.data.max_prompt_len}" if cfg.data.max_prompt_len is not None
                  else f"the longest prompt, {longest_prompt} tokens")
        out.append(
            f"{flag_for('kv', 'budget')} {kv.budget} + {flag_for('kv', 'buffer')} {kv.buffer} = {trigger(kv)} is at "
            f"least the longest sequence ({prompt} + {flag_for('sampling', 'max_new_tokens')} {max_new} = "
            f"{longest_prompt + max_new}): {flag_for('kv', 'method')} {kv.method} never compresses and the run is "
            f"dense under another name; make {flag_for('kv', 'budget')} + {flag_for('kv', 'buffer')} less than "
            f"{longest_prompt + max_new}")
    n = cfg.rollout.n_samples_per_prompt
    if cfg.sampling.temperature == 0 and n > 1:
        out.append(
            f"{flag_for('sampling', 'temperature')} 0 with {flag_for('rollout', 'n_samples_per_prompt')} {n}: greedy "
            f"samples of a prompt are identical, so every group's advantages are 0 and nothing is learned; set "
            f"{flag_for('sampling', 'temperature')} > 0 (the paper's 1.0)")
    if cfg.loss.policy_loss_mode == "cispo" and cfg.loss.eps_clip < 1.0:  # slime's warning, in its words
        out.append(
            f"{flag_for('rollout', 'advantage_estimator')} cispo with {flag_for('loss', 'eps_clip')} "
            f"{cfg.loss.eps_clip}: CISPO is canonically single-sided, but this keeps the lower clip bound "
            f"{1.0 - cfg.loss.eps_clip:g} active; set {flag_for('loss', 'eps_clip')} 1.0 (and tune "
            f"{flag_for('loss', 'eps_clip_high')}, e.g. 4.0) for MiniMax-M1's setting")
    return out


def no_gradient_warning(rollout: int, metrics: dict[str, float]) -> str | None:
    """The warning for rollout `rollout` (1-based) when every group in it had equal rewards, else None."""
    if metrics.get(ZERO_STD_FRAC, 0.0) < 1.0:
        return None
    return (f"rollout {rollout}: every group's rewards were equal ({ZERO_STD_FRAC}=1 in metrics.jsonl), so it gave "
            f"no gradient at all; if later rollouts do the same, check the grader ({flag_for('reward', 'rm_type')} / "
            f"{flag_for('reward', 'custom_rm_path')}) against the labels, or raise "
            f"{flag_for('sampling', 'temperature')} or {flag_for('rollout', 'n_samples_per_prompt')} "
            "(shown once per run)")
