"""A whole swarm on this machine: coordinator, stage servers and trainers as separate processes."""

from __future__ import annotations

import os
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from swarm.checkpoint.errors import CheckpointError
from swarm.config import RunConfig
from swarm.data import STDLIB, corpus_files, eval_batches, load_tokenizer, load_tokens
from swarm.dht import BackgroundLoop, PeerMetricsRecord, SwarmRecords, join_run, load_identity, online
from swarm.protocol import RequestLimits
from swarm.reference import EVAL_BATCHES
from swarm.routing import PipelineSettings, RemotePipeline

from .launcher import Child, end_all
from .ports import free_port
from .progress import ProgressLine
from .status import build_status

LOCAL = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 120.0  # for the coordinator to print its address, and for every stage to have servers
POLL_PERIOD = 1.0  # seconds between progress updates
EVAL_CALL_TIMEOUT = 120.0
METRICS_TIMEOUT = 5.0  # reading a server's /metrics at the end


def deal_experts(num_experts: int, servers: int) -> list[list[int]]:
    """Experts for each of `servers` expert servers: consecutive runs of ceil(E / servers), wrapping
    around, so every expert has a server (and some have two when the division is not even)."""
    if servers <= 0:
        return []
    per = -(-num_experts // servers)
    return [sorted({(i * per + j) % num_experts for j in range(per)}) for i in range(servers)]


class LocalSwarm:
    """Starts, watches and ends the processes of a local swarm; `run` returns the JSON summary."""

    def __init__(self, config_path: str, config: RunConfig, servers_per_stage: int, trainers: int,
                 log_dir: str | None, metrics_port: int | None, stop: threading.Event, in_flight: int | None = None,
                 expert_servers: int = 0):
        self.config_path = config_path
        self.expert_servers = expert_servers
        self.in_flight = in_flight  # each trainer's micro-batches in flight (None: the trainers' default)
        self.config = config
        self.servers_per_stage = servers_per_stage
        self.trainers = trainers
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="swarm-local-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = self.log_dir / "checkpoints"  # each server's, and the coordinator's
        self.metrics_port = metrics_port or free_port()
        self.stop = stop
        self.children: list[Child] = []
        self.server_ports: list[tuple[int, int]] = []  # (stage, metrics port) of every server
        self.loop = BackgroundLoop("local-loop")
        self.dht = None
        self.reports: dict[str, tuple[PeerMetricsRecord, PeerMetricsRecord]] = {}  # first and last, per trainer
        self.trainer_ports: list[int] = []  # every trainer's metrics port
        self.marks: list[dict[str, Any]] = []  # what the swarm had spent and trained at the window's start and end

    def run(self, steps: int) -> dict[str, Any]:
        started = time.monotonic()
        try:
            maddr = self._start_coordinator()
            self._start_servers(maddr)
            self._start_expert_servers(maddr)
            self._join(maddr)
            self._wait_for_servers()
            extra = [] if self.in_flight is None else ["--in-flight", str(self.in_flight)]
            extra += self._data_flags()
            self.trainer_ports = [free_port() for _ in range(self.trainers)]
            trainers = [self._child(f"trainer-{i}", "peer.cli", maddr, "--role", "trainer", "--trainer-index", str(i),
                                    "--metrics-port", str(port), *extra) for i, port in enumerate(self.trainer_ports)]
            status = self._train(steps)
            end_all(trainers)  # trainers publish their last metrics as they exit
            averaging = self._averaging_stats()
            metrics = [m for m in self.records.lookup_metrics() if m.role == "trainer"]
            print("measuring the validation loss through the swarm...", flush=True)
            val_loss, model_steps = self._validation_loss()
        finally:
            end_all(self.children)
            if self.dht is not None:
                self.dht.shutdown()
            self.loop.stop()
        samples = sum(m.samples for m in metrics)
        for m in metrics:
            self._note(m)
        # Each trainer's speed between its first and last report, by the times it stamped on them:
        # process start-up and shut-down are not training time.
        speed = sum((last.samples - first.samples) / (last.time - first.time)
                    for first, last in self.reports.values() if last.time > first.time)
        train_seconds = max((last.time - first.time for first, last in self.reports.values()), default=0.0)
        initial = [m.dict().get("initial_loss") for m in metrics]
        initial = [x for x in initial if isinstance(x, float)]
        finals = [m.loss for m in metrics if m.loss is not None]
        return {
            "initial_loss": sum(initial) / len(initial) if initial else None,
            "final_loss": sum(finals) / len(finals) if finals else None,
            "val_loss": val_loss,
            "steps": status["step"],
            "model_steps": model_steps,  # each stage's step when the validation loss was measured
            **averaging,  # per stage: late_share, round_seconds, round_start_seconds, stale_share, stale2_share, ...
            "samples": samples,
            "samples_per_second": speed,
            "wall_seconds": time.monotonic() - started,
            "train_seconds": train_seconds,
            "servers_per_stage": self.servers_per_stage,
            "trainers": self.trainers,
            "log_dir": str(self.log_dir),
            "run_checkpoint": self._newest_run_checkpoint(),
            "window": self._window(),
        }

    def _mark(self) -> None:
        """Note the time, the samples the trainers trained, every role's CPU seconds and the servers' compute
        CPU seconds: two marks make the timing window (see _window)."""
        scrapes = [self._scrape(port) for port in self.trainer_ports]
        compute = sum(self._scrape(port).get("swarm_server_compute_cpu_seconds_total", 0.0)
                      for _, port in self.server_ports)
        self.marks.append({"time": time.monotonic(), "cpu": self._cpu_by_role(), "compute": compute,
                           "samples": sum(m.get("swarm_trainer_samples_total", 0.0) for m in scrapes)})

    def _window_starts(self, step: int, steps: int) -> bool:
        """Whether a tenth of the run is trained: by the trainers' own samples, current to the poll (the step in the
        DHT is as old as the servers' last announcement, which a fast swarm can outrun from before a tenth of its
        steps to past the last, leaving no window), by the step where there is no trainer to ask."""
        start = max(1, steps // 10)
        if not self.trainer_ports:
            return step >= start
        trained = sum(self._scrape(port).get("swarm_trainer_samples_total", 0.0) for port in self.trainer_ports)
        return trained >= start * self.config.optimizer.batch_size

    def _window(self) -> dict[str, Any] | None:
        """Between the two marks (from a tenth of the steps to the last, start-up left out): seconds, samples the
        trainers trained, samples/s, and CPU seconds per sample by role, the servers' split into their compute
        threads' and the rest (RPCs, DHT, averaging, p2pd)."""
        if len(self.marks) < 2:
            return None
        first, last = self.marks[0], self.marks[-1]
        seconds, samples = last["time"] - first["time"], last["samples"] - first["samples"]
        if seconds <= 0 or samples <= 0:
            return None
        spent = {role: last["cpu"].get(role, 0.0) - first["cpu"].get(role, 0.0) for role in last["cpu"]}
        compute = last["compute"] - first["compute"]
        per_sample = {role: round(value / samples, 6) for role, value in spent.items()}
        per_sample["server_compute"] = round(compute / samples, 6)
        if "server" in spent:
            per_sample["server_outside_compute"] = round((spent["server"] - compute) / samples, 6)
        return {"seconds": seconds, "samples": samples, "samples_per_second": samples / seconds,
                "cpu_seconds_per_sample": per_sample,
                "cpu_busy_share": sum(spent.values()) / seconds / (os.cpu_count() or 1)}

    def _cpu_by_role(self) -> dict[str, float]:
        """CPU seconds so far of each role's processes: every process in each child's process group (the program,
        its DHT and averaging processes and its p2pd daemon)."""
        roles = {child.proc.pid: child.name.split("-")[0] for child in self.children}
        ticks = os.sysconf("SC_CLK_TCK")
        totals: dict[str, float] = defaultdict(float)
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ..., utime (11), stime (12)
            role = roles.get(int(fields[2]))
            if role is not None:
                totals[role] += (int(fields[11]) + int(fields[12])) / ticks
        return dict(totals)

    @staticmethod
    def _scrape(port: int) -> dict[str, float]:
        """A peer's /metrics, summed over labels by sample name, a histogram's buckets as ``<name>_le<bound>``, and
        gradient delays also by how far behind, as ``<name>_behind<steps>`` ({} if it does not answer)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=METRICS_TIMEOUT) as reply:
                text = reply.read().decode()
        except OSError:
            return {}
        sums: dict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                le = sample.labels.get("le", "")
                sums[sample.name + (f"_le{le}" if le else "")] += sample.value
                if "behind" in sample.labels:
                    sums[f"{sample.name}_behind{sample.labels['behind']}"] += sample.value
        return dict(sums)

    def _newest_run_checkpoint(self) -> dict[str, Any] | None:
        """The coordinator's newest run checkpoint: where it is and each stage's step (what swarm-export reads)."""
        from swarm.checkpoint.signing import RUN_KIND, key_path, load_public_key, verify_signature
        from swarm.checkpoint.store import RunCheckpoints
        from swarm.checkpoint.verify import verify_run

        root = self.checkpoint_dir / "coordinator"
        run_id = self.config.run_id
        try:
            signer = load_public_key(key_path(root, run_id))
        except (CheckpointError, OSError):
            return None  # no key, no checkpoint swarm-export would take
        for path in RunCheckpoints(root, run_id, self.config.checkpoint.keep).entries():
            try:
                manifest = verify_run(path, run_id=run_id, state_hash=None, read_state=False).manifest
                verify_signature(path, kind=RUN_KIND, run_id=run_id, expect=signer)  # as swarm-export checks
            except CheckpointError:
                continue
            return {"checkpoint_dir": str(root), "path": str(path), "steps": [e.step for e in manifest.stages]}
        return None

    def _data_flags(self) -> list[str]:
        """This machine's own config names the corpus: let its trainers read there (relative paths from here)."""
        corpus = self.config.data.corpus
        if corpus == STDLIB and self.config.data.tokenizer is None:
            return []
        absolute = corpus != STDLIB and Path(corpus).expanduser().is_absolute()
        return ["--data", str(corpus_files(corpus)[0]) if absolute else os.getcwd()]

    def _child(self, name: str, module: str, maddr: str | None, *args: str) -> Child:
        common = ["--host-maddrs", LOCAL, "--log-level", os.environ.get("SWARM_LOG_LEVEL", "INFO")]
        if maddr is not None:
            common += ["--initial-peers", maddr]
        child = Child(name, module, [*args, *common], self.log_dir, env=self._thread_env())
        self.children.append(child)
        return child

    def _thread_env(self) -> dict[str, str]:
        """Split this machine's cores among the servers' torch threads (unless OMP_NUM_THREADS says otherwise).

        Each torch process would otherwise take a thread per core: with several servers on a few
        cores, their threads crowd each other out, and out the averaging rounds and RPCs with them.
        """
        if "OMP_NUM_THREADS" in os.environ:
            return {}
        servers = self.config.stages.num_stages * self.servers_per_stage + self.expert_servers
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // servers))}

    def _start_coordinator(self) -> str:
        coordinator = self._child("coordinator", "coordinator.cli", None, "--config", self.config_path,
                                  "--metrics-port", str(self.metrics_port), "--checkpoint-dir",
                                  str(self.checkpoint_dir / "coordinator"))
        match = coordinator.wait_for_output(r"initial peers: (\S+)", START_TIMEOUT, self.stop)
        print(f"coordinator: {match.group(1)}\n  live page: http://127.0.0.1:{self.metrics_port}/"
              f"\n  logs:   {self.log_dir}", flush=True)
        return match.group(1)

    def _start_servers(self, maddr: str) -> None:
        for stage in range(self.config.stages.num_stages):
            for replica in range(self.servers_per_stage):
                port = free_port()
                self.server_ports.append((stage, port))
                name = f"server-{stage}-{replica}"
                self._child(name, "peer.cli", maddr, "--role", "server", "--stage", str(stage), "--device", "cpu",
                            "--metrics-port", str(port), "--checkpoint-dir", str(self.checkpoint_dir / name))

    def _start_expert_servers(self, maddr: str) -> None:
        for i, experts in enumerate(deal_experts(self.config.model.moe.num_experts if self.expert_servers else 0,
                                                 self.expert_servers)):
            name = f"expert-{i}"
            self._child(name, "peer.cli", maddr, "--role", "expert", "--experts", ",".join(map(str, experts)),
                        "--device", "cpu", "--metrics-port", str(free_port()), "--checkpoint-dir",
                        str(self.checkpoint_dir / name))

    def _averaging_stats(self) -> dict[str, list[float | None]]:
        """Per stage, from its servers' /metrics: the share of samples that came while a round ran (one
        step late), the mean seconds of a round and of its start (batch handed over to group formed),
        and the share of backwards whose stage had stepped once or more / twice or more since their forward."""
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * self.config.stages.num_stages)
        for stage, port in self.server_ports:
            for name, value in self._scrape(port).items():  # (a server that died: the figures are of those that answer)
                sums[name][stage] += value

        def ratio(top: list[float], bottom: list[float]) -> list[float | None]:
            return [round(x / n, 4) if n else None for x, n in zip(top, bottom)]

        staleness = "swarm_server_backward_staleness_steps"
        backwards = sums[f"{staleness}_count"]
        delays = "swarm_server_gradient_delay_samples_total"  # (swarm.delays)
        counted = sums[delays]
        return {
            "late_share": ratio(sums["swarm_averaging_late_samples_total"], sums["swarm_server_samples_total"]),
            "round_seconds": ratio(sums["swarm_averaging_round_seconds_sum"],
                                   sums["swarm_averaging_round_seconds_count"]),
            "round_start_seconds": ratio(sums["swarm_averaging_round_start_seconds_sum"],
                                         sums["swarm_averaging_round_start_seconds_count"]),
            "stale_share": ratio([n - x for n, x in zip(backwards, sums[f"{staleness}_bucket_le0.0"])], backwards),
            "stale2_share": ratio([n - x for n, x in zip(backwards, sums[f"{staleness}_bucket_le1.0"])], backwards),
            # of the samples counted in steps, those whose gradient was of parameters a step or more behind the step's,
            # and those on a prediction of the parameters of the step they counted in (a step early)
            "behind_share": ratio([a + b for a, b in zip(sums[f"{delays}_behind1"], sums[f"{delays}_behind2"])],
                                  counted),
            "early_share": ratio(sums[f"{delays}_behind-1"], counted),
            # what the stage's servers sent in averaging rounds per sample they served
            "averaging_bytes_per_sample": ratio(sums["swarm_averaging_bytes_sent_total"],
                                                sums["swarm_server_samples_total"]),
        }

    def _join(self, maddr: str) -> None:
        self.loop.start()
        identity = load_identity(None)
        self.dht, _, _ = join_run([maddr], identity, self.loop, host_maddrs=[LOCAL])
        self.records = SwarmRecords(self.dht, self.config.run_id, identity)

    def _status(self) -> dict[str, Any]:
        servers = self.records.lookup_all_servers(self.config.stages.num_stages)
        metrics = self.records.lookup_metrics()
        for m in metrics:
            self._note(m)
        return build_status(self.config.run_id, servers, metrics)

    def _note(self, report: PeerMetricsRecord) -> None:
        if report.role != "trainer" or report.samples == 0:
            return
        first, last = self.reports.get(report.peer_id, (report, report))
        self.reports[report.peer_id] = (first, report if report.time >= last.time else last)

    def _check_children(self) -> None:
        for child in self.children:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}: {child.last_error()} "
                                   f"(log: {child.log_path})")

    def _wait_for_servers(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        shown = ""
        while True:
            status = self._status()
            online = [s["online"] for s in status["stages"]]
            line = "waiting for servers: " + ", ".join(f"stage {i} {n}/{self.servers_per_stage}"
                                                       for i, n in enumerate(online))
            if line != shown:
                print(line, flush=True)
                shown = line
            unhosted = self._unhosted_experts()
            if unhosted:
                line += f"; experts without a server: {unhosted}"
            if all(n >= self.servers_per_stage for n in online) and not unhosted:
                return
            self._check_children()
            if time.monotonic() > deadline:
                raise RuntimeError(f"servers did not come ONLINE within {START_TIMEOUT:.0f}s; see {self.log_dir}")
            if self.stop.wait(POLL_PERIOD):
                raise KeyboardInterrupt

    def _unhosted_experts(self) -> list[int]:
        if not self.expert_servers:
            return []
        hosted = {e for r in online(self.records.lookup_expert_hosts()) for e in r.experts}
        return [e for e in range(self.config.model.moe.num_experts) if e not in hosted]

    def _train(self, steps: int) -> dict[str, Any]:
        progress = ProgressLine(steps, every=1)
        last_step = -1
        try:
            while True:
                status = self._status()
                if status["step"] != last_step or progress.live:
                    last_step = status["step"]
                    servers = " ".join(str(s["online"]) for s in status["stages"])
                    progress.update(min(status["step"], steps), loss=status["loss"] if status["loss"] else "-",
                                    samples_per_s=float(status["samples_per_second"]), servers_per_stage=servers)
                if not self.marks and self._window_starts(status["step"], steps):
                    self._mark()  # the window starts once training runs (start-up and the first rounds left out)
                if status["step"] >= steps:
                    self._mark()
                    return status
                self._check_children()
                if self.stop.wait(POLL_PERIOD):
                    raise KeyboardInterrupt
        finally:
            progress.close()

    def _validation_loss(self) -> tuple[float, list[int]]:
        """Mean validation loss through the swarm, and the step of each stage that answered."""
        config = self.config
        pipeline = self.loop.run(self._make_pipeline(), EVAL_CALL_TIMEOUT)
        tokens = load_tokens(config.data, "val", load_tokenizer(config.data))
        total, count = 0.0, 0
        for i, (x, y) in enumerate(eval_batches(tokens, config.model.seq_len, config.optimizer.micro_batch_size,
                                                EVAL_BATCHES)):
            loss = self.loop.run(pipeline.evaluate(x, y, request_id=f"eval:{i}"), EVAL_CALL_TIMEOUT)
            total += loss * x.shape[0]
            count += x.shape[0]
        return total / count, [pipeline.stage_steps.get(stage, 0) for stage in range(config.stages.num_stages)]

    async def _make_pipeline(self) -> RemotePipeline:
        p2p = await self.dht.replicate_p2p()
        config = self.config
        pipeline = RemotePipeline(p2p, config.run_id, config.stages.num_stages, config.stages.wire,
                                  PipelineSettings.from_config(config.network), hidden_size=config.model.d_model,
                                  limits=RequestLimits.of(config).stage)
        servers = self.records.lookup_all_servers(config.stages.num_stages)
        pipeline.update_servers({k: [r.peer_id for r in online(v)] for k, v in servers.items()})
        return pipeline
