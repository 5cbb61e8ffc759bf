"""Chaos driver: kill -9 a training run again and again at chosen or random moments, resume it each time,
and compare what it ends with against an uninterrupted run of the same command.

Kills come in two kinds, both SIGKILL:
- targeted: the run is started with SLIME_SPARSE_FAULT=<point>@<hit> (slime_sparse/utils/faults.py) and
  kills itself the <hit>-th time it reaches that point; the record file it leaves says where it landed
  (point, and from the call stack whether a generation was a rollout or an evaluation);
- external: the driver sends SIGKILL after a random delay; the run's fault trace names the last point it
  passed before dying.
Before each resume the driver checks that the checkpoint the run will load (utils.checkpoint's own choice)
is identical, tensor for tensor, to the reference run's checkpoint of that step, and afterwards that the
run's log says it loaded that one: no partial or stale checkpoint is ever loaded. After the last kill
the run completes; its final weights, optimizer state and data position must equal the reference's
bit for bit, and metrics.jsonl must hold every rollout exactly once with the reference's values.

Every process a run starts inherits a tag in its environment; after each kill the driver waits for all
tagged processes (grader workers, Ray's processes) to be gone and counts the ones that outlive it.

    python tests/helpers/chaos.py --kills 20 --out runs/chaos              # the tiny recipe, embedded
    python tests/helpers/chaos.py --kills 10 --use-ray --out runs/chaos_ray  # each attempt also kills an engine actor
    python tests/helpers/chaos.py --kills 8 --async --out runs/chaos_async   # --async: rollout k + 1 generating while k trains
Under --async a resumed run is not the uninterrupted one bit for bit (its rollout after the checkpoint comes from
the restored weights, the uninterrupted one's from older ones): the driver checks instead that metrics.jsonl holds
every rollout once and that samples.jsonl trains, step by step, the prompts of the uninterrupted run, none twice.
(`python -m pytest -m chaos -s` runs both as tests.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from slime_sparse.resume import CONFIG_KEY, experiment_changes  # noqa: E402
from slime_sparse.utils.checkpoint import latest_checkpoint, list_checkpoints  # noqa: E402
from slime_sparse.utils.faults import FAULT_ENV, RECORD_ENV, TRACE_ENV  # noqa: E402

TAG_ENV = "SLIME_SPARSE_CHAOS_TAG"
# metrics that legitimately differ between an interrupted and an uninterrupted run
VOLATILE = re.compile(r"^(time|perf/.*|rollout/weight_version|.*seconds.*)$")

# The targeted fault kinds. Each attempt arms one at a random hit within the next two rollouts' worth of
# hits (counted per rollout in the uninterrupted run) and never past what is left of the run.
TARGETS = ("engine.step", "learner.backward", "checkpoint.staged", "checkpoint.renamed", "checkpoint.prune",
           "metrics.write")


def load_recipe() -> tuple[list[str], object]:
    """The tiny recipe's flags (its default variant, Sparse-RL) and assets config (examples/tiny_cpu/run.py)."""
    spec = importlib.util.spec_from_file_location("tiny_cpu_run", ROOT / "examples" / "tiny_cpu" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [*module.RECIPE, *module.VARIANTS["sparse_rl"]], module.ASSETS


@dataclass
class Attempt:
    fault: str  # "point@hit", "external@<seconds>" or "none"
    rc: int
    seconds: float
    landed: str | None = None  # where the kill landed; None if the run was not killed
    resumed_from: int | None = None  # checkpoint step the run loaded (None: fresh start)
    leftover_processes: int = 0
    actor_kills: list[str] = field(default_factory=list)  # Ray: actors killed while the trainer went on


@dataclass
class ChaosReport:
    attempts: list[Attempt] = field(default_factory=list)
    reference_seconds: float = 0.0
    engine_restarts: int = 0  # Ray: engine actors killed and replaced mid-rollout
    problems: list[str] = field(default_factory=list)

    @property
    def kills(self) -> list[Attempt]:
        """Attempts in which the trainer or one of its actors was killed."""
        return [a for a in self.attempts if a.landed is not None or a.actor_kills]

    @property
    def resumes(self) -> int:
        return sum(a.resumed_from is not None for a in self.attempts)

    def landed_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for a in self.attempts:
            for where in ([f"trainer: {a.landed}"] if a.landed else []) + [f"actor: {w}" for w in a.actor_kills]:
                counts[where] = counts.get(where, 0) + 1
        return dict(sorted(counts.items()))

    def table(self) -> str:
        lines = [f"{'#':>3} {'fault':<40} {'rc':>4} {'s':>6} {'resumed':>7}  landed in"]
        for i, a in enumerate(self.attempts):
            resumed = "-" if a.resumed_from is None else str(a.resumed_from)
            where = "; ".join(([a.landed] if a.landed else []) + [f"actor: {w}" for w in a.actor_kills])
            lines.append(f"{i:>3} {a.fault:<40} {a.rc:>4} {a.seconds:>6.1f} {resumed:>7}  {where or '(completed)'}")
        lines.append("")
        lines.append(f"attempts with a kill: {len(self.kills)}; resumes: {self.resumes}; engine actors restarted "
                     f"mid-rollout: {self.engine_restarts}; chaos wall time {sum(a.seconds for a in self.attempts):.0f}"
                     f" s, uninterrupted run {self.reference_seconds:.0f} s")
        for where, n in self.landed_counts().items():
            lines.append(f"  {n:>3} x {where}")
        lines.append("problems: " + ("none" if not self.problems else ""))
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- running


def train_command(args: list[str]) -> list[str]:
    # `python -m slime_sparse.train` is the slime-sparse-train console script (its main()) with this interpreter
    return [sys.executable, "-m", "slime_sparse.train", *args]


def run_once(args: list[str], log_path: Path, env: dict, *, kill_after_s: float | None = None,
             timeout_s: float = 4 * 3600.0) -> tuple[int, float, int]:
    """Run the trainer to its end (or until killed); returns (exit code, seconds, pid)."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(train_command(args), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            proc.wait(timeout=kill_after_s if kill_after_s is not None else timeout_s)
        except subprocess.TimeoutExpired:
            if kill_after_s is None:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"training run exceeded {timeout_s:.0f} s; see {log_path}") from None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    return proc.returncode, time.monotonic() - t0, proc.pid


def tagged_processes(tag: str) -> list[int]:
    """PIDs of live processes whose environment carries `TAG_ENV=tag` (Linux /proc)."""
    needle = f"{TAG_ENV}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat") as st:
                        if st.read().split(") ", 1)[1].startswith("Z"):
                            continue  # a zombie holds no resources; its parent reaps it
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return f"{pid} " + fh.read().replace(b"\0", b" ").decode(errors="replace")[:100]
    except OSError:
        return f"{pid} (gone)"


# Ray's per-node agents outlive a SIGKILLed driver that started the cluster by ~50-65 s on this machine: they see
# the raylet die within 2 s, then report it to the (dead) GCS before exiting. Measured with a bare
# `ray.init(address="local")` driver and no slime_sparse code, so theirs is Ray's own grace, not a leak of ours.
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
RAY_AGENT_GRACE_S = 150.0


def wait_for_no_processes(tag: str, grace_s: float) -> list[int]:
    """Processes of the run alive after their grace: `grace_s`, Ray's agents RAY_AGENT_GRACE_S."""
    start = time.monotonic()
    while True:
        waited, left = time.monotonic() - start, tagged_processes(tag)
        overdue = [p for p in left
                   if waited > (RAY_AGENT_GRACE_S if _cmdline(p).split(" ", 1)[-1].startswith(RAY_AGENTS) else grace_s)]
        if not left or overdue:
            return overdue
        time.sleep(0.5)


def resumed_step(log_text: str) -> int | None:
    m = re.search(r"resumed from (\S+) at rollout (\d+)", log_text)
    return int(m.group(2)) if m else None


def classify(record: dict) -> str:
    """Where a targeted kill landed, from its point and call stack."""
    point, stack = record["point"], record["stack"]
    if point == "engine.step":
        if "evaluate_modes" in stack:
            return "evaluation (generation)"
        if "call_rollout_fn" in stack:  # the train rollout: in the loop, or in --async's rollout thread
            return "rollout (generation)"
        return "generation (engine actor)"
    return {
        "learner.backward": "learner step (after backward, before optimizer step)",
        "checkpoint.staged": "checkpoint write (files staged, not yet complete)",
        "checkpoint.renamed": "checkpoint write (renamed, `latest` not updated)",
        "checkpoint.prune": "checkpoint write (pruning an old one)",
        "metrics.write": "metrics write (half a line written)",
    }[point]


def last_traced(trace: Path, pid: int) -> str:
    if not trace.exists():
        return "start-up (no fault point reached yet)"
    lines = [ln.split(" ", 1) for ln in trace.read_text().splitlines()]
    mine = [name for p, name in lines if p == str(pid)]
    return f"after {mine[-1]} (external kill)" if mine else "start-up (external kill)"


# ----------------------------------------------------------------------------------------------- checks


def _tensors_equal(a, b, where: str, problems: list[str]) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b)):
            problems.append(f"{where} differs")
        return
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            problems.append(f"{where}: keys differ")
            return
        for k in a:
            _tensors_equal(a[k], b[k], f"{where}.{k}", problems)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            problems.append(f"{where}: lengths differ")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _tensors_equal(x, y, f"{where}[{i}]", problems)
        return
    if a != b:
        problems.append(f"{where}: {a!r} != {b!r}")


def compare_checkpoints(got: Path, want: Path, *, rng: bool = True) -> list[str]:
    """Bit-exact comparison of two training checkpoints (weights, optimizer + scheduler, RNG, loop state)."""
    problems: list[str] = []
    _tensors_equal(load_file(str(got / "model" / "model.safetensors")),
                   load_file(str(want / "model" / "model.safetensors")), "weights", problems)
    _tensors_equal(torch.load(got / "optimizer.pt", weights_only=True),
                   torch.load(want / "optimizer.pt", weights_only=True), "optimizer", problems)
    if rng:
        _tensors_equal(torch.load(got / "rng.pt", weights_only=True),
                       torch.load(want / "rng.pt", weights_only=True), "rng", problems)
    sa, sb = (json.loads((p / "trainer_state.json").read_text()) for p in (got, want))
    # the run config a checkpoint records: its experiment part must match (resume's own rule); paths and
    # schedule fields differ between the two runs by design
    ca, cb = (s.get("extra", {}).pop(CONFIG_KEY, None) for s in (sa, sb))
    problems += [f"trainer_state config: {c}" for c in experiment_changes(ca, cb or {})]
    _tensors_equal(sa, sb, "trainer_state", problems)
    shown = [f"{got.name}: {p}" for p in problems[:5]]
    return shown + ([f"{got.name}: ... and {len(problems) - 5} more differences"] if len(problems) > 5 else [])


def compare_metrics(got: Path, want: Path, num_rollout: int) -> list[str]:
    """Every rollout id exactly once, evaluations once per evaluated step, and the reference's values."""
    problems = []
    rows = [json.loads(line) for line in got.read_text().splitlines()]
    ref = [json.loads(line) for line in want.read_text().splitlines()]
    steps = [r["step"] for r in rows if "rollout/reward_mean" in r]
    if steps != list(range(1, num_rollout + 1)):
        lost = sorted(set(range(1, num_rollout + 1)) - set(steps))
        repeated = sorted({s for s in steps if steps.count(s) > 1})
        problems.append(f"metrics.jsonl rollout ids: lost {lost}, repeated {repeated}")
    if len(rows) != len(ref):
        problems.append(f"metrics.jsonl has {len(rows)} records, the uninterrupted run {len(ref)}")
    for a, b in zip(rows, ref):
        ka = {k: v for k, v in a.items() if not VOLATILE.match(k)}
        kb = {k: v for k, v in b.items() if not VOLATILE.match(k)}
        if ka != kb:
            diff = sorted(k for k in ka.keys() | kb.keys() if ka.get(k) != kb.get(k))
            problems.append(f"metrics.jsonl step {a.get('step')}: differs from the uninterrupted run in {diff[:6]}")
    return problems


# ----------------------------------------------------------------------------------------------- the loop


def plan_faults(kills: int, rng: random.Random, *, external: int, targets=TARGETS) -> list[str]:
    """`kills` fault kinds: the targeted points in turn, `external` random-delay kills, shuffled."""
    kinds = [targets[i % len(targets)] for i in range(kills - external)] + ["external"] * external
    rng.shuffle(kinds)
    return kinds


# Rollouts a point needs to be reached at all. A prune happens at a save only once --keep-last (2) newer checkpoints
# exist, so it may not come in the run's last rollout: armed there, the run would end with the kill unlanded.
NEEDS_ROLLOUTS = {"checkpoint.prune": 2}
STANDBY = "learner.backward"  # reached in every rollout


def next_fault(specs: list[str], i: int, remaining: int) -> str:
    """The i-th planned kind, or (swapped into place) the next planned one that can land in `remaining` rollouts;
    the stand-by point when none can."""
    for j in range(i, len(specs)):
        if NEEDS_ROLLOUTS.get(specs[j], 1) <= remaining:
            specs[i], specs[j] = specs[j], specs[i]
            return specs[i]
    specs[i] = STANDBY
    return STANDBY


def point_counts(trace: Path, pid: int) -> dict[str, int]:
    """How often process `pid` reached each fault point (written to the trace at its normal exit)."""
    for line in trace.read_text().splitlines() if trace.exists() else []:
        p, _, rest = line.partition(" ")
        if p == str(pid) and rest.startswith("counts "):
            return json.loads(rest[len("counts "):])
    return {}


def pick_hit(rng: random.Random, per_rollout: float, remaining: int) -> int:
    """A hit within the next two rollouts and within what is left of the run."""
    return rng.randint(1, max(1, int(min(2.0, remaining) * per_rollout)))


def compare_samples(got: Path, want: Path, num_rollout: int) -> list[str]:
    """--async: every rollout once in metrics.jsonl, and samples.jsonl training the reference's prompts at every step,
    each prompt at one step only."""
    problems = []
    steps = [json.loads(line)["step"] for line in (got / "metrics.jsonl").read_text().splitlines()
             if "rollout/reward_mean" in json.loads(line)]
    if steps != list(range(1, num_rollout + 1)):
        problems.append(f"metrics.jsonl rollout ids {steps}, expected 1..{num_rollout} once each")

    def prompts(run: Path) -> dict[int, list[int]]:
        by_step: dict[int, list[int]] = {}
        for line in (run / "samples.jsonl").read_text().splitlines():
            r = json.loads(line)
            by_step.setdefault(r["step"], []).append(r["prompt_index"])
        return by_step

    a, b = prompts(got), prompts(want)
    if a != b:
        diff = sorted(s for s in a.keys() | b.keys() if a.get(s) != b.get(s))
        problems.append(f"samples.jsonl: the prompts trained at steps {diff[:6]} differ from the uninterrupted run's")
    seen: dict[int, int] = {}
    for step, ps in a.items():
        for p in set(ps):
            if p in seen:
                problems.append(f"samples.jsonl: prompt {p} trained at steps {seen[p]} and {step}")
            seen[p] = step
    return problems


def run_chaos(args: list[str], out: Path, *, num_rollout: int, kills: int = 20, external: int = 3, seed: int = 0,
              targets=TARGETS, actor_faults: bool = False, max_attempts: int | None = None,
              log=print) -> ChaosReport:
    """Reference run, then attempts until `kills` kills of the trainer landed (each resumed by the next
    attempt), a final attempt to the end, then the comparisons.

    actor_faults (Ray runs): every attempt also arms engine.step at a random hit, which kills an engine actor
    mid-rollout (the trainer must finish that rollout on the restarted actor). External kills land at a random
    moment of the first two rollouts' worth of time (start-up included).
    """
    rng = random.Random(seed)
    report = ChaosReport()
    exact = "--async" not in args  # a resumed --async run trains the same prompts, from other weights
    out.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    base_env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, RECORD_ENV, TRACE_ENV)}
    base_env.update({TAG_ENV: tag, "PYTHONPATH": os.pathsep.join([str(ROOT), base_env.get("PYTHONPATH", "")])})

    ref_dir, run_dir = out / "reference", out / "chaos"
    common = [*args, "--num-rollout", str(num_rollout)]
    ref_info = out / "reference.json"  # reused when the reference of the same command is there
    if not ref_info.exists() or json.loads(ref_info.read_text())["args"] != common:
        log(f"reference run -> {ref_dir}")
        if ref_dir.exists():
            shutil.rmtree(ref_dir)  # from another command or an interrupted reference: start over
        ref_trace = out / "reference_trace.txt"
        ref_trace.unlink(missing_ok=True)
        rc, seconds, pid = run_once([*common, "--run-dir", str(ref_dir), "--keep-last", "1000"],
                                    out / "reference.log", dict(base_env, **{TRACE_ENV: str(ref_trace)}))
        if rc != 0:
            raise RuntimeError(f"the uninterrupted run failed (exit {rc}); see {out / 'reference.log'}")
        ref_info.write_text(json.dumps({"args": common, "seconds": seconds, "counts": point_counts(ref_trace, pid)}))
    info = json.loads(ref_info.read_text())
    report.reference_seconds = info["seconds"]
    # points the trainer process did not reach ran in Ray actors: about once per rollout there
    per_rollout = {p: info["counts"][p] / num_rollout if info["counts"].get(p) else 1.0 for p in TARGETS}
    rollout_s = info["seconds"] / num_rollout
    max_len = int(args[len(args) - 1 - args[::-1].index("--rollout-max-response-len") + 1])
    ref_ckpts = {step: Path(p) for step, p in list_checkpoints(str(ref_dir / "checkpoints"))}

    chaos_args = [*common, "--run-dir", str(run_dir)]
    save_dir = run_dir / "checkpoints"
    if actor_faults:  # engine steps run in the engine actors, which the actor fault already targets
        targets = tuple(t for t in targets if t != "engine.step")
    specs = plan_faults(kills, rng, external=external, targets=targets)
    max_attempts = max_attempts or 3 * kills
    trace = out / "fault_trace.txt"
    trace.unlink(missing_ok=True)
    if run_dir.exists():  # a fresh chaos run each time (the reference is reused)
        shutil.rmtree(run_dir)
    done = False
    while not done:
        n = len(report.attempts)
        final = len(report.kills) >= kills or n >= max_attempts
        expected = latest_checkpoint(str(save_dir))
        step = 0
        if expected is not None:
            step = int(json.loads((Path(expected) / "trainer_state.json").read_text())["step"])
            if step not in ref_ckpts:
                report.problems.append(f"attempt {n}: checkpoint step {step} has no reference")
            elif exact:  # what the run is about to load must be the reference's checkpoint of that step, bit for bit
                report.problems += compare_checkpoints(Path(expected), ref_ckpts[step])
        env = dict(base_env, **{TRACE_ENV: str(trace)})
        records = out / f"faults-{n:03d}"
        remaining = num_rollout - step
        kind = "none" if final else next_fault(specs, len(report.kills), remaining)
        armed = [] if kind in ("none", "external") else [f"{kind}@{pick_hit(rng, per_rollout[kind], remaining)}"]
        if actor_faults and not final:  # counted per engine actor, which decodes up to max_len steps a call
            armed.append(f"engine.step@{rng.randint(1, max_len)}")
        if armed:
            env.update({FAULT_ENV: ",".join(armed), RECORD_ENV: str(records)})
        kill_after = rng.uniform(1.0, 10.0 + min(2, remaining) * rollout_s) if kind == "external" else None
        fault = f"external@{kill_after:.1f}s" if kill_after is not None else ",".join(armed) or "none"
        log_path = out / f"attempt-{n:03d}.log"
        rc, seconds, pid = run_once(chaos_args, log_path, env, kill_after_s=kill_after)
        text = log_path.read_text(errors="replace")
        attempt = Attempt(fault=fault, rc=rc, seconds=seconds, resumed_from=resumed_step(text))
        for path in sorted(records.glob("*.json")) if records.exists() else []:
            rec = json.loads(path.read_text())
            if rec["pid"] == pid:
                attempt.landed = classify(rec)
                if rc != -signal.SIGKILL:
                    report.problems.append(f"attempt {n}: fault {rec['point']} fired but the exit code is {rc}")
            else:
                attempt.actor_kills.append(classify(rec))
        if attempt.landed is None and rc == -signal.SIGKILL:
            attempt.landed = last_traced(trace, pid)
        if expected is not None and attempt.resumed_from is None:
            if "resumed from" in text or attempt.landed is None or "start-up" not in attempt.landed:
                report.problems.append(f"attempt {n}: expected to resume from {expected}; see {log_path}")
        elif expected is not None and f"resumed from {expected} " not in text:
            report.problems.append(f"attempt {n}: expected to resume from {expected}; see {log_path}")
        if rc not in (0, -signal.SIGKILL) and attempt.landed is None:
            if not attempt.actor_kills or final:
                report.problems.append(f"attempt {n} ({fault}) failed with exit code {rc}; see {log_path}")
        leftover = wait_for_no_processes(tag, grace_s=60.0)
        attempt.leftover_processes = len(leftover)
        if leftover:
            names = [_cmdline(p) for p in leftover]
            report.problems.append(f"attempt {n}: {len(leftover)} process(es) outlived the run: {names}")
            for p in leftover:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        restarts = text.count("died mid-rollout")
        report.engine_restarts += restarts
        engine_kills = sum(k.startswith("generation") for k in attempt.actor_kills)
        if attempt.landed is None and restarts != engine_kills:
            report.problems.append(f"attempt {n}: {engine_kills} engine actor(s) killed mid-rollout but {restarts} "
                                   f"restarted; see {log_path}")
        report.attempts.append(attempt)
        log(f"attempt {n}: {fault} rc={rc} {seconds:.0f}s resumed_from={attempt.resumed_from} "
            f"landed={attempt.landed} actor_kills={attempt.actor_kills}")
        done = rc == 0 and attempt.landed is None  # the run completed
    if len(report.kills) < kills:
        report.problems.append(f"only {len(report.kills)} of {kills} kills landed in {len(report.attempts)} attempts")

    final_ckpt = save_dir / f"rollout_{num_rollout:06d}"
    if exact:
        report.problems += compare_checkpoints(final_ckpt, ref_ckpts[num_rollout])
        report.problems += compare_metrics(run_dir / "metrics.jsonl", ref_dir / "metrics.jsonl", num_rollout)
    else:
        report.problems += compare_samples(run_dir, ref_dir, num_rollout)
    stale = [p.name for p in save_dir.iterdir() if p.name.startswith("tmp-")]
    if stale:
        report.problems.append(f"partial checkpoints left behind: {stale}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/chaos")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--external", type=int, default=3, help="how many of the kills are random-delay kills")
    parser.add_argument("--num-rollout", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--use-ray", action="store_true",
                        help="the run on Ray; every attempt also kills an engine actor mid-rollout")
    parser.add_argument("--async", dest="async_train", action="store_true",
                        help="the run under --async (compared prompt for prompt, not bit for bit)")
    ns, extra = parser.parse_known_args(argv)
    args = recipe_args(use_ray=ns.use_ray) + (["--async"] if ns.async_train else []) + extra
    report = run_chaos(args, Path(ns.out), num_rollout=ns.num_rollout, kills=ns.kills, external=ns.external,
                       seed=ns.seed, actor_faults=ns.use_ray)
    print(report.table())
    return 1 if report.problems else 0


def recipe_args(*, use_ray: bool = False, cache_dir: str = ".cache/tiny_assets") -> list[str]:
    """The tiny recipe's command (examples/tiny_cpu/run.py) with a checkpoint after every rollout."""
    from slime_sparse.tasks.assets import build_assets

    recipe, assets_cfg = load_recipe()
    assets = build_assets(str(ROOT / cache_dir), assets_cfg)
    args = ["--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path),
            "--eval-prompt-data", str(assets.test_path), *recipe, "--save-interval", "1", "--rm-num-workers", "1"]
    if use_ray:
        args += ["--use-ray", "--ray-address", "local", "--ray-cpus-per-actor", "0.5", "--ray-timeout", "300"]
    return args


if __name__ == "__main__":
    sys.exit(main())
