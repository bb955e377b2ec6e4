"""Servers move to a slow stage: a swarm's throughput with rebalancing / the best static placement found by trying.

    .venv/bin/python bench/rebalance.py [--slowdown 3] [--base-slowdown 1] [--window 60] [--minutes 5]
                                        [--rebalance-period 30] [--static-minutes M]
    .venv/bin/python bench/rebalance.py --kill-stage 1 [--rebalance-period 60]

configs/tiny.yaml cut to 3 stages (6 blocks, a batch of 256 so that averaging rounds are rare), 6 servers and
2 trainers on 127.0.0.1. Two of the servers are slowed `--slowdown` times (swarm-peer --inject-slowdown: each
task holds their compute thread that many times as long, and they announce that much less throughput). Each
phase is a fresh swarm:

- static placements, every server pinned with --stage: the start (both slow servers on stage 0, 2 servers a
  stage) and the placements that pair each slow server with a fast one; each measured over `--window` after
  `--warmup`, or, with `--static-minutes M`, window by window for M minutes from its first micro-batch, as the
  rebalancing phase is (a swarm here speeds up over its first minutes, by a fifth or more, whatever its
  placement: one window of a static swarm against the rebalancing phase's later windows flatters rebalancing);
- rebalancing: the start placement with every server `--movable` (start there, move as --stage auto does),
  measured window by window for `--minutes`, with the moves each server made.

With `--kill-stage K` instead: the 6 servers all at one speed, 2 a stage, every one movable, the coordinator
keeping the run's checkpoints; once it holds one of stage K, both servers of stage K are SIGKILLed. Printed:
when a server of another stage decided to move there and when it served it (in rebalancing periods), when
stage K stepped again, and samples/s in a window before the kill and in one after.

It prints samples/s per static placement, and per window of the rebalancing phase that figure over the best
static one (with `--static-minutes`: over the best static placement's own window of the same index, where it
has one), with where the servers were. On 2 shared cores the six servers and two trainers share the CPU,
so the figures carry that noise; the slow servers' extra time is a wait, not CPU. `--base-slowdown B` slows
every server B times more (the slow ones B x slowdown): the servers, not the shared CPU, then bound the
swarm, as they would on machines of their own.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.config import RunConfig  # noqa: E402
from tests.procs import SERVING_LINE, ProcSet, metric, start_coordinator, start_peer  # noqa: E402

SLOW, FAST = "S", "F"
START = ((SLOW, SLOW), (FAST, FAST), (FAST, FAST))  # 2 a stage, both slow servers on stage 0
CANDIDATES = (((SLOW, FAST), (SLOW, FAST), (FAST, FAST)), ((FAST, FAST), (SLOW, FAST), (SLOW, FAST)),
              ((SLOW, FAST), (FAST, FAST), (SLOW, FAST)))
POLL = 1.0
BALANCED = ((FAST, FAST), (FAST, FAST), (FAST, FAST))
MOVING = r"moving from stage (\d+) to stage (\d+) \(([a-z ]+)\)"
PULLED = "pulled the checkpoint of stage {stage} at step"


def label(placement) -> str:
    return " | ".join("".join(stage) for stage in placement)


def make_config(path: Path, checkpoint_every: int | None = None, max_wait: float | None = None) -> RunConfig:
    config = RunConfig.load("configs/tiny.yaml")
    config.network.max_wait = max_wait
    if checkpoint_every is not None:
        config.checkpoint.every_steps = checkpoint_every
        config.checkpoint.every_seconds = 3600.0
    config.run_id = "bench-rebalance"
    config.model.n_layer = 6
    config.stages.num_stages = 3
    config.optimizer.batch_size = 256
    config.optimizer.total_steps = 100_000  # no schedule end within the bench
    config.validate()
    config.save(path)
    return config


class Swarm:
    """A coordinator, the servers of `placement` (pinned, or movable from there) and the trainers."""

    def __init__(self, workdir: Path, config_path: Path, placement, slowdown: float, base: float, movable: bool,
                 period: float, trainers: int, in_flight: int, checkpoints: Path | None = None):
        self.procs = ProcSet(workdir)
        try:
            self._start(config_path, placement, slowdown, base, movable, period, trainers, in_flight, checkpoints)
        except BaseException:  # a server that never came up: stop what did
            self.procs.stop_all()
            raise

    def _start(self, config_path: Path, placement, slowdown: float, base: float, movable: bool, period: float,
               trainers: int, in_flight: int, checkpoints: Path | None) -> None:
        # with `checkpoints`, the coordinator keeps the run's checkpoints there (the state of a stage whose
        # servers all died) and each server writes its own; else nobody writes any
        self.coordinator = coordinator = start_coordinator(
            self.procs, config_path, *(("--checkpoint-dir", str(checkpoints / "coordinator")) if checkpoints else ()))
        self.servers = []  # (kind, Peer)
        # one server of each stage, then the second of each: a movable server alone on its stage stays, and
        # once a stage has two no stage is empty (a movable server would fill an empty stage at once)
        order = sorted(((k, stage, kind) for stage, kinds in enumerate(placement) for k, kind in enumerate(kinds)))
        for n, (_, stage, kind) in enumerate(order):
            args = ["--role", "server", "--stage", str(stage),
                    *(("--checkpoint-dir", str(checkpoints / f"server{n}")) if checkpoints else ("--no-checkpoints",))]
            factor = base * (slowdown if kind == SLOW else 1.0)
            if factor > 1.0:
                args += ["--inject-slowdown", str(factor)]
            if movable:
                args += ["--movable", "--rebalance-period", str(period)]
            # one at a time: each measures the speed it announces with the CPU to itself, as on a machine of
            # its own (six measuring at once on 2 cores announced speeds 2-5x apart for the same factor)
            self.servers.append((kind, start_peer(self.procs, coordinator, *args)))
            self.servers[-1][1].wait_serving()
        self.trainers = [start_peer(self.procs, coordinator, "--role", "trainer", "--trainer-index", str(k),
                                    "--in-flight", str(in_flight)) for k in range(trainers)]

    def samples(self) -> float:
        return sum(metric(t.metrics_port, "swarm_trainer_samples_total") or 0.0 for t in self.trainers)

    def where(self) -> str:
        """The live servers' stages now, from the last 'serving stage K' each printed."""
        stages: dict[int, list[str]] = {k: [] for k in range(len(START))}
        for kind, server in self.servers:
            if server.proc.popen.poll() is None:
                stages.setdefault(stage_of(server), []).append(kind)
        return " | ".join("".join(sorted(stages.get(k, []), reverse=True)) or "-" for k in sorted(stages))

    def moves(self) -> int:
        return sum(int(metric(s.metrics_port, "swarm_server_moves_total") or 0) for _, s in self.servers)

    def wait_training(self, samples: float, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.samples() < samples:
            if time.monotonic() > deadline:
                raise SystemExit(f"the swarm did not train {samples:.0f} samples within {timeout:.0f} s")
            time.sleep(POLL)

    def close(self) -> None:
        self.procs.stop_all()


def stage_of(server) -> int:
    """The stage the server said it serves last (-1: none yet)."""
    found = re.findall(SERVING_LINE, server.proc.stderr(), flags=re.MULTILINE)
    return int(found[-1][0]) if found else -1


def rate(swarm: Swarm, seconds: float) -> float:
    began, before = time.monotonic(), swarm.samples()
    while time.monotonic() - began < seconds:
        time.sleep(POLL)
    return (swarm.samples() - before) / (time.monotonic() - began)


def windows(swarm: Swarm, minutes: float, window: float) -> list[float]:
    began, got = time.monotonic(), []
    while time.monotonic() - began < minutes * 60:
        got.append(rate(swarm, window))
    return got


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def kill_stage(args, tmp: Path) -> None:
    """A balanced swarm of movable servers loses both servers of one stage: when does another take it, and does
    the run go on?"""
    config_path = Path(tmp) / "run.yaml"
    config = make_config(config_path, checkpoint_every=2)
    victim, period = args.kill_stage, args.rebalance_period
    swarm = Swarm(Path(tmp), config_path, BALANCED, slowdown=1.0, base=args.base_slowdown, movable=True,
                  period=period, trainers=args.trainers, in_flight=args.in_flight, checkpoints=Path(tmp) / "ckpt")
    try:
        swarm.wait_training(config.optimizer.micro_batch_size, 300)
        swarm.coordinator.proc.wait_until(lambda: PULLED.format(stage=victim) in swarm.coordinator.proc.stderr(),
                                          300, f"the coordinator pulling a checkpoint of stage {victim}")
        before = rate(swarm, args.window)
        dead = [server for _, server in swarm.servers if stage_of(server) == victim]
        alive = [server for _, server in swarm.servers if stage_of(server) != victim]
        moved_before = {id(s): len(re.findall(MOVING, s.proc.stderr())) for s in alive}
        steps = {id(s): s.metric("swarm_server_step") or 0.0 for s in alive}
        placed = swarm.where()
        for server in dead:
            server.proc.kill()
        killed = time.monotonic()
        print(f"before: {before:.1f} samples/s, servers {placed}; killed the {len(dead)} servers of stage {victim}",
              flush=True)
        decided = serving = None
        mover = None
        while time.monotonic() - killed < args.minutes * 60 and serving is None:
            for server in alive:
                found = re.findall(MOVING, server.proc.stderr())[moved_before[id(server)]:]
                if decided is None and any(int(target) == victim for _, target, _ in found):
                    decided, mover = time.monotonic() - killed, server
            if mover is not None and stage_of(mover) == victim:
                serving = time.monotonic() - killed
            time.sleep(POLL)
        if serving is None:
            raise SystemExit(f"no server took stage {victim} within {args.minutes:g} minutes; servers {swarm.where()}")
        source, _, reason = re.findall(MOVING, mover.proc.stderr())[-1]
        print(f"a server of stage {source} moved to stage {victim} ({reason}): decided {decided:.0f} s after the kill, "
              f"serving at {serving:.0f} s = {serving / period:.2f} rebalancing periods of {period:g} s "
              f"(the dead servers' records live {config.network.record_ttl:g} s)", flush=True)
        resumed = mover.metric("swarm_server_step") or 0.0
        mover.proc.wait_until(lambda: (mover.metric("swarm_server_step") or 0.0) >= resumed + 2, 300,
                              f"stage {victim} stepping again")
        stepped = time.monotonic() - killed
        after = rate(swarm, args.window)
        others = ", ".join(f"{steps[id(s)]:.0f} -> {s.metric('swarm_server_step') or 0.0:.0f}"
                           for s in alive if s is not mover)
        print(f"stage {victim} stepping again {stepped:.0f} s after the kill (from step {resumed:.0f}); the other "
              f"servers' steps since the kill {others}; after: {after:.1f} samples/s ({after / before:.2f} of before), "
              f"servers {swarm.where()}", flush=True)
    finally:
        swarm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slowdown", type=float, default=3.0, help="how much slower the two slow servers are")
    p.add_argument("--base-slowdown", type=float, default=1.0, help="every server slowed this much besides")
    p.add_argument("--warmup", type=float, default=30.0)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--minutes", type=float, default=5.0, help="length of the rebalancing phase")
    p.add_argument("--static-minutes", type=float, default=0.0,
                   help="measure each static placement window by window this long (0: one window after --warmup)")
    p.add_argument("--rebalance-period", type=float, default=30.0)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--candidates", type=int, default=len(CANDIDATES), help="balanced static placements to try")
    p.add_argument("--max-wait", type=float, default=None,
                   help="the run's network.max_wait (default: none set, each stage server's auto_max_wait; inf: "
                        "servers never refuse by time)")
    p.add_argument("--kill-stage", type=int, choices=(0, 1, 2),
                   help="instead: a balanced swarm of 6 movable servers loses both servers of this stage (SIGKILL); "
                        "how long until another server serves it, and the run stepping again (--minutes: how long "
                        "to wait for the move)")
    args = p.parse_args()
    if args.kill_stage is not None:
        with tempfile.TemporaryDirectory(prefix="bench-rebalance-") as tmp:
            kill_stage(args, Path(tmp))
        return
    with tempfile.TemporaryDirectory(prefix="bench-rebalance-") as tmp:
        config_path = Path(tmp) / "run.yaml"
        config = make_config(config_path, max_wait=args.max_wait)
        common = dict(slowdown=args.slowdown, base=args.base_slowdown, period=args.rebalance_period,
                      trainers=args.trainers, in_flight=args.in_flight)
        static: dict[str, list[float]] = {}  # placement -> samples/s, window by window
        for placement in (START, *CANDIDATES[:args.candidates]):
            swarm = Swarm(Path(tmp), config_path, placement, movable=False, **common)
            try:
                swarm.wait_training(config.optimizer.micro_batch_size, 300)
                if args.static_minutes > 0:
                    static[label(placement)] = windows(swarm, args.static_minutes, args.window)
                else:
                    time.sleep(args.warmup)
                    static[label(placement)] = [rate(swarm, args.window)]
                refused = sum(server.proc.stderr().count("past its limit (max_wait") for _, server in swarm.servers)
            finally:
                swarm.close()
            got = static[label(placement)]
            print(f"static {label(placement):<12} {mean(got):7.1f} samples/s"
                  + (f" (windows: {', '.join(f'{x:.1f}' for x in got)})" if len(got) > 1 else "")
                  + f"; {refused} calls refused by time", flush=True)
        best_label = max(static, key=lambda k: mean(static[k]))
        best = static[best_label]
        print(f"best static placement: {best_label} ({mean(best):.1f} samples/s); the start: "
              f"{mean(static[label(START)]) / mean(best):.3f} of it", flush=True)
        swarm = Swarm(Path(tmp), config_path, START, movable=True, **common)
        try:
            swarm.wait_training(config.optimizer.micro_batch_size, 300)
            began, k = time.monotonic(), 0
            while time.monotonic() - began < args.minutes * 60:
                got = rate(swarm, args.window)
                against = best[k] if k < len(best) else mean(best)
                same = f" in its window {k + 1}" if k < len(best) and len(best) > 1 else ""
                print(f"rebalancing t={time.monotonic() - began:5.0f}s {got:7.1f} samples/s, {got / against:.3f} of "
                      f"the best static{same}; servers {swarm.where()}; moves {swarm.moves()}", flush=True)
                k += 1
            for kind, server in swarm.servers:  # why each stayed (or went) at its last check
                checks = re.findall(r"rebalancing check: (.*)$", server.proc.stderr(), flags=re.MULTILINE)
                print(f"last check of a {'slow' if kind == SLOW else 'fast'} server: "
                      f"{checks[-1] if checks else 'none yet'}", flush=True)
        finally:
            swarm.close()


if __name__ == "__main__":
    main()
