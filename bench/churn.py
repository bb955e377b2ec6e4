"""Training under churn: a server killed every N seconds (and a replacement started) vs no churn.

Three fresh swarms, one after the other, each a coordinator and 2 servers on each of 2 stages,
with a trainer in this process training the same number of samples (same data order, same
initial weights). The first and the last run undisturbed (their gap shows the machine's drift).
In the second, every --every seconds one server (the oldest of the stage whose turn it is) is
SIGKILLed with all its processes, and a replacement for its stage is started at once (a kill
waits, if need be, until the stage's previous replacement serves: killing the last replica that
holds a stage's state would restart that stage from scratch, a different test). Printed
side by side: samples/s of each and the ratio churn / no churn (goal >= 0.8),
trainer crashes (goal 0; a crashed trainer is restarted for the rest of the samples), failed calls
(each retried on another server), micro-batches dropped, and the losses at the end.

All programs share this machine's cores, so a replacement's start-up (imports, state download)
competes with training here as it would not on a volunteer's own machine.

    .venv/bin/python bench/churn.py              # 12000 samples per run, a kill every 30 s
    .venv/bin/python bench/churn.py --quick      # 1600 samples, a kill every 12 s (about 6 minutes)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from coordinator.launcher import Child, end_all
from coordinator.local_swarm import free_port
from swarm.config import RunConfig
from swarm.data import eval_batches, load_tokenizer, load_tokens
from swarm.dht import BackgroundLoop, SwarmRecords, join_run, load_identity
from swarm.logs import FORMAT
from swarm.reference import EVAL_BATCHES
from swarm.routing import RemotePipeline
from swarm.trainer import Trainer, TrainerOptions

LOCAL = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 180.0  # a program's start, and every stage getting its servers ONLINE
EVAL_TIMEOUT = 120.0  # one validation batch through the swarm
LAST_MICRO_BATCHES = 32  # the training loss at the end: mean over this many last micro-batches
POLL = 0.2
SERVING = re.compile(r"serving stage \d+ of \d+ ")


class Swarm:
    """A coordinator, `servers_per_stage` servers on each stage, and this process as a peer."""

    def __init__(self, config: RunConfig, config_path: Path, log_dir: Path, servers_per_stage: int):
        self.config, self.log_dir = config, log_dir
        self.servers: list[list[Child]] = [[] for _ in range(config.stages.num_stages)]  # oldest first
        self.metrics_ports: dict[str, int] = {}  # server name -> its /metrics port
        self.started = 0
        self.coordinator, self.dht, self.loop = None, None, BackgroundLoop("bench-loop")
        try:
            self.coordinator = Child("coordinator", "coordinator.cli", ["--config", str(config_path),
                                                                        "--host-maddrs", LOCAL], log_dir)
            self.maddr = self.coordinator.wait_for_output(r"initial peers: (\S+)", START_TIMEOUT,
                                                          threading.Event()).group(1)
            for stage in range(config.stages.num_stages):
                for _ in range(servers_per_stage):
                    self.add_server(stage)
            self.loop.start()
            identity = load_identity(None)
            self.dht, _, _ = join_run([self.maddr], identity, self.loop, host_maddrs=[LOCAL])
            self.records = SwarmRecords(self.dht, config.run_id, identity)
            self._wait_online(servers_per_stage)
        except BaseException:  # a start that fails leaves nothing running
            self.close()
            raise

    def add_server(self, stage: int) -> None:
        """Start a server of `stage`, with a /metrics port and a checkpoint directory of its own in the run's
        log directory: with the default (~/.cache/swarm/checkpoints, shared by every run of this run id on
        this machine) a run would resume from what an earlier run, or a test, left there."""
        name, port = f"server-{stage}-{self.started}", free_port()
        self.started += 1
        self.metrics_ports[name] = port
        self.servers[stage].append(Child(name, "peer.cli", [
            "--initial-peers", self.maddr, "--host-maddrs", LOCAL, "--role", "server", "--stage", str(stage),
            "--device", "cpu", "--metrics-port", str(port),
            "--checkpoint-dir", str(self.log_dir / "checkpoints" / name),
        ], self.log_dir))

    def may_kill(self, stage: int) -> bool:
        """Whether every server of the stage serves: killing one then leaves another holding its state."""
        return all(SERVING.search(c.log_path.read_text(errors="replace")) for c in self.servers[stage])

    def kill_and_replace(self, stage: int) -> None:
        """SIGKILL the stage's oldest server (its whole process group) and start a new one."""
        victim = self.servers[stage].pop(0)
        victim.proc.send_signal(signal.SIGKILL)
        victim.end()  # reaps it and kills the rest of its group: DHT, p2pd, averaging
        self.add_server(stage)

    def replace_exited(self) -> list[str]:
        """Start a new server for each one that exited by itself; returns how they ended."""
        ended = []
        for stage, children in enumerate(self.servers):
            for child in [c for c in children if not c.alive()]:
                children.remove(child)
                ended.append(f"{child.name} exited ({child.last_error()})")
                child.end()
                self.add_server(stage)
        return ended

    def _wait_online(self, count: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            servers = self.records.lookup_all_servers(self.config.stages.num_stages)
            if all(sum(r.state == "ONLINE" for r in servers.get(stage, [])) >= count
                   for stage in range(self.config.stages.num_stages)):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stages did not get {count} servers ONLINE each; see {self.log_dir}")
            time.sleep(POLL)

    def close(self) -> None:
        # Servers before the coordinator, so they can still announce OFFLINE through the DHT.
        end_all([c for stage in self.servers for c in stage])
        end_all([self.coordinator] if self.coordinator is not None else [])
        if self.dht is not None:
            self.dht.shutdown()
        self.loop.stop()


class TrainerRun:
    """Trains `samples` with in-process trainers (a new one after a crash) while `during()` runs."""

    def __init__(self, swarm: Swarm, samples: int, in_flight: int):
        self.swarm, self.samples, self.in_flight = swarm, samples, in_flight
        self.crashes, self.failed_calls, self.dropped, self.done = 0, 0, 0, 0
        self.recent: list[float] = []  # losses of the last micro-batches
        self.first_sample_at: float | None = None
        self.trainer: Trainer | None = None  # the one training now
        self.pipeline: RemotePipeline | None = None  # the last trainer's, for the validation loss

    def run(self, churn_every: float | None) -> dict:
        finished = threading.Event()
        thread = threading.Thread(target=self._train, args=(finished,), name="trainer")
        thread.start()
        kills, stage, late, exits = 0, 0, 0.0, []
        try:
            while self.first_sample_at is None and not finished.wait(POLL):
                pass
            next_kill = None if churn_every is None else time.monotonic() + churn_every
            while not finished.wait(POLL):
                for line in self.swarm.replace_exited():
                    exits.append(line)
                    print(f"  {line}; a replacement is starting", flush=True)
                # A kill is postponed while its stage's last replacement is not serving yet: killing
                # the only replica holding the stage's state would restart the stage from scratch.
                if next_kill is not None and time.monotonic() >= next_kill and self.swarm.may_kill(stage):
                    delay = time.monotonic() - next_kill
                    late += delay
                    self.swarm.kill_and_replace(stage)
                    print(f"  killed a server of stage {stage} at {self.progress()} samples ({delay:.0f} s late); "
                          "a replacement is starting", flush=True)
                    kills, stage = kills + 1, (stage + 1) % len(self.swarm.servers)
                    next_kill = time.monotonic() + churn_every
        finally:
            thread.join()
        seconds = time.monotonic() - self.first_sample_at
        return {"samples": self.done, "seconds": seconds, "speed": self.done / seconds, "kills": kills,
                "late": late / max(kills, 1), "exits": len(exits),
                "crashes": self.crashes, "failed_calls": self.failed_calls, "dropped": self.dropped,
                "train_loss": sum(self.recent) / len(self.recent), "val_loss": self._validation_loss()}

    def progress(self) -> int:
        trainer = self.trainer
        return self.done + (trainer.samples_done if trainer is not None else 0)

    def _train(self, finished: threading.Event) -> None:
        swarm = self.swarm
        try:
            while self.done < self.samples:
                registry = CollectorRegistry()
                options = TrainerOptions(trainer_index=0, in_flight=self.in_flight,
                                         max_samples=self.samples - self.done)
                trainer = self.trainer = Trainer(swarm.config, swarm.dht, swarm.records, swarm.loop, options, registry)
                watcher = threading.Thread(target=self._watch, args=(trainer,), daemon=True)
                watcher.start()
                try:
                    trainer.run(threading.Event())
                except Exception as e:  # noqa: BLE001 - counted: the figure of merit is that there are none
                    self.crashes += 1
                    print(f"  the trainer crashed ({e!r}); starting a new one", flush=True)
                finally:
                    self.trainer = None
                    self.done += trainer.samples_done
                    self.recent = ([loss for _, loss, _ in trainer.recent] or self.recent)[-LAST_MICRO_BATCHES:]
                    if trainer.pipeline is not None:
                        self.pipeline = trainer.pipeline
                        self.failed_calls += trainer.pipeline.stats.failures
                    self.dropped += int(registry.get_sample_value("swarm_trainer_failed_micro_batches_total") or 0)
        finally:
            finished.set()

    def _watch(self, trainer: Trainer) -> None:
        while self.first_sample_at is None:
            if trainer.samples_done > 0:
                self.first_sample_at = time.monotonic()
            time.sleep(POLL)

    def _validation_loss(self) -> float:
        """Mean loss over the run's validation batches, through the swarm as it is at the end."""
        config, pipeline, loop = self.swarm.config, self.pipeline, self.swarm.loop
        tokens = load_tokens(config.data, "val", load_tokenizer(config.data))
        total, count = 0.0, 0
        batches = eval_batches(tokens, config.model.seq_len, config.optimizer.micro_batch_size, EVAL_BATCHES)
        for i, (x, y) in enumerate(batches):
            total += loop.run(pipeline.evaluate(x, y, request_id=f"eval:{i}"), EVAL_TIMEOUT) * x.shape[0]
            count += x.shape[0]
        return total / count


def measure(config: RunConfig, churn_every: float | None, samples: int, servers_per_stage: int,
            in_flight: int, log_dir: Path) -> dict:
    log_dir.mkdir(parents=True)
    path = log_dir / "run.yaml"
    config.save(path)
    swarm = Swarm(config, path, log_dir, servers_per_stage)
    try:
        return TrainerRun(swarm, samples, in_flight).run(churn_every)
    finally:
        swarm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--quick", action="store_true", help="fewer samples and faster churn (a few minutes in all)")
    p.add_argument("--every", type=float, help="seconds between kills (default 30; 12 with --quick)")
    p.add_argument("--samples", type=int, help="samples per run (default 12000; 1600 with --quick)")
    p.add_argument("--servers-per-stage", type=int, default=2)
    p.add_argument("--in-flight", type=int, default=TrainerOptions.in_flight)
    p.add_argument("--log-dir", help="keep the programs' logs here (default: a temporary directory, removed)")
    args = p.parse_args()
    every = args.every or (12.0 if args.quick else 30.0)
    samples = args.samples or (1600 if args.quick else 12000)
    config = RunConfig.load(args.config)
    os.environ["OMP_NUM_THREADS"] = "1"  # the servers share this machine's cores; children inherit it
    # The undisturbed run goes before and after the churned one: a change in the machine's load
    # shows up as a gap between the two instead of skewing the ratio unnoticed.
    runs = [("no churn (before)", None), (f"a kill every {every:g} s", every), ("no churn (after)", None)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        logs = Path(args.log_dir or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        # the in-process trainer's log (each failed call is a warning) goes beside the programs' logs
        logging.basicConfig(filename=logs / "trainer.log", level=logging.INFO, format=FORMAT, datefmt="%H:%M:%S")
        for i, (name, churn) in enumerate(runs):
            print(f"{name}: training {samples} samples (logs: {logs / f'run-{i}'})...", flush=True)
            results[name] = measure(config, churn, samples, args.servers_per_stage, args.in_flight,
                                    logs / f"run-{i}")
    print(f"\n{config.stages.num_stages} stages x {args.servers_per_stage} servers, one trainer "
          f"({args.in_flight} in flight), {samples} samples per run:")
    print(f"{'':<22} {'samples/s':>9} {'seconds':>8} {'kills':>6} {'server exits':>13} {'crashes':>8} "
          f"{'failed calls':>13} {'dropped':>8} {'train loss':>11} {'val loss':>9}")
    for name, r in results.items():
        print(f"{name:<22} {r['speed']:>9.1f} {r['seconds']:>8.0f} {r['kills']:>6} {r['exits']:>13} "
              f"{r['crashes']:>8} {r['failed_calls']:>13} {r['dropped']:>8} {r['train_loss']:>11.3f} "
              f"{r['val_loss']:>9.3f}")
    before, churned, after = results.values()
    calm = (before["speed"] + after["speed"]) / 2
    print(f"ratio (churn / mean of no churn): {churned['speed'] / calm:.2f}  (goal >= 0.8); "
          f"trainer crashes under churn: {churned['crashes']} (goal 0); kills were {churned['late']:.0f} s late "
          "on average (a stage's previous replacement still starting)")


if __name__ == "__main__":
    main()
