"""MoE training under expert-server churn: one of 4 expert servers killed every N seconds (and a
replacement started) vs no churn. Also reached as `bench/moe.py --part churn`.

Three fresh swarms, one after the other, like bench/churn.py (whose Swarm and TrainerRun this
reuses): each a coordinator, one server per stage (stages are not churned here) and 4 expert servers
each hosting half the experts of every MoE block, so every expert has 2 hosts (for 8 experts:
0-3, 4-7, 0-3, 4-7), with a trainer in this process training the same number of samples (same
data order, same initial weights). The first and last run undisturbed (their gap shows the
machine's drift). In the second, every --every seconds the oldest expert server whose experts all
have another serving host (alive, and logged "hosting experts ...") is SIGKILLed with its whole
process group, and a replacement is started at once with the victim's experts named explicitly
(`--experts 0,1,2,3`): with `--experts auto` the replacement would pick the experts with the fewest
ONLINE or JOINING hosts, and the victim's record still says ONLINE until network.record_ttl passes,
so it could pick the wrong half and leave an expert with a single host. Only a serving server is
a victim (killing one still starting would disturb nothing but its own start); a kill waits while
no server may go (a replacement still starting), and how late kills were on average is printed.
Every program gets a checkpoint directory of its own under the run's log directory, so no run
resumes from what an earlier one (or a test of the same run id) left in ~/.cache/swarm/checkpoints;
training starts once every expert is hosted twice in the DHT and the stage servers had time to
look the expert servers up (2 x swarm.serving.stage.EXPERT_LOOKUP_PERIOD).

Printed side by side: samples/s of each run and the ratio churn / mean of no churn (goal >= 0.8),
kills, how long replacements took to serve (start-up, imports, the experts' state taken from their
other host), expert servers that exited by themselves, trainer crashes (goal 0; a crashed trainer
is restarted for the rest of the samples), the trainer's failed calls to stage servers and
micro-batches dropped, the stage servers' calls to expert servers that failed
(swarm_moe_expert_call_failures_total), top-k slots that went without their expert
(swarm_moe_unavailable_slots_total) and experts a backward missed (swarm_moe_backward_lost_experts_total),
read from the stage servers' /metrics at the end of each run, the losses at the end (the
training loss over the last micro-batches; the validation loss through the swarm), the share of
the machine's cores other programs took meanwhile (OthersCpu), and each stage's and each live
expert server's step as announced at the end: an expert server announces the least step of the
experts it hosts, so a replica that missed backwards shows as lagging behind the stages.

All programs share this machine's cores, so a replacement's start-up competes with training here
as it would not on a volunteer's own machine. 4800 samples is the config's whole schedule
(optimizer.total_steps 300 x batch 16); at about 20 samples/s the churned run sees 7 or more kills.

    .venv/bin/python bench/moe_churn.py              # 4800 samples per run, a kill every 30 s (about 13 minutes)
    .venv/bin/python bench/moe_churn.py --quick      # 2000 samples per run, a kill every 12 s (6.5-7 minutes)
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
import urllib.request
from collections import defaultdict
from pathlib import Path

from churn import LOCAL, START_TIMEOUT, Swarm, TrainerRun
from prometheus_client.parser import text_string_to_metric_families

from coordinator.launcher import Child, end_all
from swarm.config import RunConfig
from swarm.dht import ServerState
from swarm.logs import FORMAT
from swarm.serving.stage import EXPERT_LOOKUP_PERIOD

ROOT = Path(__file__).resolve().parent.parent
HOSTING = re.compile(r"hosting experts \[.* as (\w+)")
POLL = 0.2
METRICS_TIMEOUT = 5.0
STAGE_METRICS = {  # what the stage servers count of their calls to expert servers
    "swarm_moe_expert_calls_total": "expert_calls",
    "swarm_moe_expert_call_failures_total": "expert_call_failures",
    "swarm_moe_unavailable_slots_total": "unavailable_slots",
    "swarm_moe_backward_lost_experts_total": "backward_lost",
}


class OthersCpu:
    """The share of this machine's CPU that programs other than this benchmark's took while it ran.

    A thread reads /proc every second. This process's own are this process, its descendants, and
    every process in a session one of its descendants leads (a server's DHT process and p2pd, also
    once their server was SIGKILLed and they were orphaned); any other process is another program's,
    and what CPU time it gained between two reads is counted. Processes that live less than a second
    between reads, and the last second of one that ends, are missed: a lower bound."""

    PERIOD = 1.0

    def __init__(self):
        self.me = os.getpid()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.sessions: set[int] = set()  # led by a descendant of this process
        self.first: dict[tuple[int, int], float] = {}  # other programs' processes: CPU seconds when first read
        self.last: dict[tuple[int, int], float] = {}
        self.started = time.monotonic()
        self.stop = threading.Event()
        self._read(initial=True)
        self.thread = threading.Thread(target=self._watch, name="others-cpu", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(self.PERIOD):
            self._read(initial=False)

    def _read(self, initial: bool) -> None:
        procs = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # ended meanwhile
                continue
            ppid, sid = int(fields[1]), int(fields[3])
            cpu = (int(fields[11]) + int(fields[12])) / self.tick
            procs[int(entry)] = (ppid, sid, int(fields[19]), cpu)
        mine = {self.me}
        grew = True
        while grew:  # descendants, however deep
            more = {pid for pid, (ppid, _, _, _) in procs.items() if ppid in mine and pid not in mine}
            mine |= more
            grew = bool(more)
        self.sessions |= {pid for pid in mine if pid != self.me and procs.get(pid, (0, 0))[1] == pid}
        for pid, (_, sid, born, cpu) in procs.items():
            if pid in mine or sid in self.sessions:
                continue
            key = (pid, born)
            self.first.setdefault(key, cpu if initial else 0.0)
            self.last[key] = cpu

    def share(self) -> float:
        """Stop watching; the share of all cores that other programs took since this was made."""
        self.stop.set()
        self.thread.join()
        self._read(initial=False)
        seconds = sum(self.last[k] - self.first[k] for k in self.last)
        return seconds / max((time.monotonic() - self.started) * (os.cpu_count() or 1), 1e-9)


class ExpertChild:
    """An expert server program, the experts it hosts, and when it started and began to serve."""

    def __init__(self, child: Child, experts: list[int]):
        self.child, self.experts = child, experts
        self.started = time.monotonic()
        self.serving_after: float | None = None  # seconds from start to "hosting experts"
        self.peer_id: str | None = None

    def serving(self) -> bool:
        if self.serving_after is None and self.child.alive():
            match = HOSTING.search(self.child.log_path.read_text(errors="replace"))
            if match:
                self.serving_after, self.peer_id = time.monotonic() - self.started, match.group(1)
        return self.serving_after is not None and self.child.alive()


class ExpertSwarm(Swarm):
    """bench/churn.py's Swarm with one server per stage (each with a /metrics port) and expert servers.

    The expert churn rides on replace_exited, which TrainerRun.run calls every poll once training
    has begun: it replaces expert servers that exited by themselves and, with `churn_every`, kills
    and replaces one when its time has come (its first kill `churn_every` after the first call).
    """

    def __init__(self, config: RunConfig, config_path: Path, log_dir: Path, expert_lists: list[list[int]],
                 churn_every: float | None = None):
        self.experts: list[ExpertChild] = []  # oldest first
        self.retired: list[ExpertChild] = []  # killed or exited
        self.expert_started = 0
        self.every, self.next_kill = churn_every, None
        self.kills, self.late = 0, 0.0
        self.initial = len(expert_lists)
        super().__init__(config, config_path, log_dir, servers_per_stage=1)
        try:
            for experts in expert_lists:
                self.add_expert_server(experts)
            self._wait_hosted(expert_lists)
        except BaseException:
            self.close()
            raise

    def add_expert_server(self, experts: list[int]) -> None:
        name = f"expert-{self.expert_started}"
        self.expert_started += 1
        child = Child(name, "peer.cli", ["--initial-peers", self.maddr, "--host-maddrs", LOCAL, "--role", "expert",
                                         "--experts", ",".join(map(str, experts)), "--device", "cpu",
                                         "--checkpoint-dir", str(self.log_dir / "checkpoints" / name)], self.log_dir)
        self.experts.append(ExpertChild(child, experts))

    def _wait_hosted(self, expert_lists: list[list[int]]) -> None:
        """Until every expert server logged "hosting experts" and the DHT shows each expert's hosts ONLINE."""
        need = defaultdict(int)
        for experts in expert_lists:
            for e in experts:
                need[e] += 1
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            for x in self.experts:
                if not x.child.alive():
                    raise RuntimeError(f"{x.child.name} exited: {x.child.last_error()}")
            if all(x.serving() for x in self.experts):
                online = defaultdict(int)
                for r in self.records.lookup_expert_hosts():
                    if r.state == ServerState.ONLINE.value:
                        for e in r.experts:
                            online[e] += 1
                if all(online[e] >= n for e, n in need.items()):
                    # The stage servers look the expert servers up every EXPERT_LOOKUP_PERIOD seconds: a
                    # trainer starting before they did would find every expert lost.
                    time.sleep(2 * EXPERT_LOOKUP_PERIOD)
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the expert servers did not all serve within {START_TIMEOUT:.0f}s; "
                                   f"see {self.log_dir}")
            time.sleep(POLL)

    def replace_exited(self) -> list[str]:
        ended = super().replace_exited()
        for x in self.experts:  # notes when each starts to serve (its log is read until it does)
            x.serving()
        for x in [x for x in self.experts if not x.child.alive()]:
            self.experts.remove(x)
            self.retired.append(x)
            ended.append(f"{x.child.name} (experts {x.experts}) exited ({x.child.last_error()})")
            x.child.end()
            self.add_expert_server(x.experts)
        if self.every is not None:
            self._churn()
        return ended

    def victim(self) -> ExpertChild | None:
        """The oldest serving expert server each of whose experts has another serving host, if any (one
        still starting is not a victim: killing it would disturb nothing but its own start)."""
        serving = [x for x in self.experts if x.serving()]
        for x in serving:
            if all(any(e in other.experts for other in serving if other is not x) for e in x.experts):
                return x
        return None

    def _churn(self) -> None:
        now = time.monotonic()
        if self.next_kill is None:
            self.next_kill = now + self.every
        if now < self.next_kill:
            return
        victim = self.victim()
        if victim is None:  # a replacement still starting: the kill waits
            return
        delay = now - self.next_kill
        self.late += delay
        self.experts.remove(victim)
        self.retired.append(victim)
        victim.child.proc.send_signal(signal.SIGKILL)
        victim.child.end()  # reaps it and SIGKILLs the rest of its process group: DHT, p2pd
        self.add_expert_server(victim.experts)
        self.kills += 1
        self.next_kill = time.monotonic() + self.every
        print(f"  {time.strftime('%H:%M:%S')} killed {victim.child.name} (experts {victim.experts}, {delay:.0f} s "
              f"late); {self.experts[-1].child.name} is starting with the same experts", flush=True)

    def stage_metrics(self) -> dict[str, float]:
        """The stage servers' expert call counters, summed over those that answer (a replaced one's are lost)."""
        sums = dict.fromkeys(STAGE_METRICS.values(), 0.0)
        for port in self.metrics_ports.values():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=METRICS_TIMEOUT) as reply:
                    text = reply.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in STAGE_METRICS:
                        sums[STAGE_METRICS[sample.name]] += sample.value
        return sums

    def announced_steps(self) -> dict[str, list]:
        """Each stage's and each live expert server's step, as their DHT records say (up to an announce
        period old). An expert server's is the least any expert it hosts took: a replica that missed
        backwards lags behind the stages."""
        stages = self.records.lookup_all_servers(self.config.stages.num_stages)
        steps = {r.peer_id: r.step for r in self.records.lookup_expert_hosts()}
        return {"stages": [max((r.step for r in stages.get(s, [])), default=0)
                           for s in range(self.config.stages.num_stages)],
                "experts": [(x.child.name, _span(x.experts), steps.get(x.peer_id)) for x in self.experts
                            if x.serving()]}

    def replacement_seconds(self) -> list[float]:
        """Seconds from start to serving of every replacement (all but the first len(lists) servers)."""
        children = sorted(self.retired + self.experts, key=lambda x: x.started)[self.initial:]
        for x in children:
            x.serving()
        return [x.serving_after for x in children if x.serving_after is not None]

    def close(self) -> None:
        end_all([x.child for x in self.experts])
        super().close()


def _span(experts: list[int]) -> str:
    """0-3 for [0, 1, 2, 3]; 0,2,5 otherwise."""
    if experts == list(range(experts[0], experts[-1] + 1)) and len(experts) > 1:
        return f"{experts[0]}-{experts[-1]}"
    return ",".join(map(str, experts))


def measure(config: RunConfig, churn_every: float | None, samples: int, in_flight: int | None, log_dir: Path,
            expert_lists: list[list[int]]) -> dict:
    log_dir.mkdir(parents=True)
    path = log_dir / "run.yaml"
    config.save(path)
    others = OthersCpu()
    swarm = ExpertSwarm(config, path, log_dir, expert_lists, churn_every)
    try:
        result = TrainerRun(swarm, samples, in_flight).run(None)  # the churn comes from swarm.replace_exited
        result.update(kills=swarm.kills, late=swarm.late / max(swarm.kills, 1), **swarm.stage_metrics())
        result["expert_steps"] = swarm.announced_steps()
        ready = swarm.replacement_seconds()
        result["replacement_seconds"] = sum(ready) / len(ready) if ready else None
    finally:
        swarm.close()
    result["others_cpu"] = others.share()
    return result


def run(config_path: str, every: float, samples: int, in_flight: int | None = None,
        experts_per_server: int | None = None, expert_servers: int = 4, log_dir: str | None = None) -> dict:
    config = RunConfig.load(config_path)
    moe = config.model.moe
    if moe is None or not moe.expert_servers:
        raise SystemExit(f"{config_path}: the churn part needs model.moe.expert_servers (experts on expert servers)")
    per = experts_per_server or max(1, moe.num_experts // 2)
    # Consecutive runs of `per` experts, wrapping around: for 8 experts, 4 servers, 4 each: 0-3, 4-7, 0-3, 4-7.
    expert_lists = [sorted({(i * per + j) % moe.num_experts for j in range(per)}) for i in range(expert_servers)]
    hosts = [sum(e in x for x in expert_lists) for e in range(moe.num_experts)]
    if min(hosts) < 2:
        raise SystemExit(f"{expert_servers} expert servers of {per} experts ({expert_lists}) leave some expert "
                         "a single host: a kill would lose it")
    os.environ["OMP_NUM_THREADS"] = "1"  # the servers share this machine's cores; children inherit it
    runs = [("no churn (before)", None), (f"a kill every {every:g} s", every), ("no churn (after)", None)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-moe-churn-") as tmp:
        logs = Path(log_dir or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        # the in-process trainer's log (each failed call is a warning) goes beside the programs' logs
        logging.basicConfig(filename=logs / "trainer.log", level=logging.INFO, format=FORMAT, datefmt="%H:%M:%S",
                            force=True)
        for i, (name, churn) in enumerate(runs):
            print(f"{name}: training {samples} samples (logs: {logs / f'run-{i}'})...", flush=True)
            started = time.monotonic()
            results[name] = measure(config, churn, samples, in_flight, logs / f"run-{i}", expert_lists)
            results[name]["wall_seconds"] = time.monotonic() - started
    return {"config": config_path, "samples": samples, "every": every, "expert_lists": expert_lists,
            "in_flight": in_flight, "runs": results}


def report(r: dict) -> None:
    lists = " ".join(_span(x) for x in r["expert_lists"])
    print(f"\n{r['config']}: 1 server per stage, {len(r['expert_lists'])} expert servers (experts {lists}), "
          f"one trainer in this process, {r['samples']} samples per run:")
    print(f"{'':<20} {'samples/s':>9} {'seconds':>7} {'kills':>5} {'ready s':>7} {'exits':>5} {'crashes':>7} "
          f"{'failed':>6} {'dropped':>7} {'exp calls':>9} {'exp fail':>8} {'unavail':>7} {'bwd lost':>8} "
          f"{'train loss':>10} {'val loss':>8} {'others':>6}")
    for name, x in r["runs"].items():
        ready = "-" if x["replacement_seconds"] is None else f"{x['replacement_seconds']:.0f}"
        print(f"{name:<20} {x['speed']:>9.1f} {x['seconds']:>7.0f} {x['kills']:>5} {ready:>7} {x['exits']:>5} "
              f"{x['crashes']:>7} {x['failed_calls']:>6} {x['dropped']:>7} {x['expert_calls']:>9.0f} "
              f"{x['expert_call_failures']:>8.0f} {x['unavailable_slots']:>7.0f} {x['backward_lost']:>8.0f} "
              f"{x['train_loss']:>10.3f} {x['val_loss']:>8.3f} {100 * x['others_cpu']:>5.0f}%")
    for name, x in r["runs"].items():
        steps = x["expert_steps"]
        hosts = ", ".join(f"{who} [{span}] {'?' if step is None else step}" for who, span, step in steps["experts"])
        print(f"{name}: steps at the end, as announced: stages {steps['stages']}; expert servers (the least step "
              f"of any expert each hosts): {hosts}")
    before, churned, after = r["runs"].values()
    calm = (before["speed"] + after["speed"]) / 2
    r["ratio"] = churned["speed"] / calm
    print(f"ratio (churn / mean of no churn): {r['ratio']:.2f}  (goal >= 0.8); trainer crashes under churn: "
          f"{churned['crashes']} (goal 0); kills were {churned['late']:.0f} s late on average (no server could go: "
          "a replacement still starting)")
    print("columns: ready s = mean seconds from a replacement's start to its 'hosting experts'; failed = the "
          "trainer's failed calls to stage servers; exp calls / exp fail = stage servers' calls to expert servers "
          "/ those that failed; unavail = top-k slots that went without their expert; bwd lost = experts a "
          "backward missed (stage servers' /metrics at the end of the run); others = the share of this machine's "
          f"{os.cpu_count()} cores that programs other than this benchmark's took during the run", flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--every", type=float, help="churn: seconds between kills (default 30; 12 with --quick)")
    p.add_argument("--samples", type=int, help="churn: samples per run (default 4800; 2000 with --quick)")
    p.add_argument("--in-flight", type=int, default=None, help="churn: the trainer's micro-batches in flight "
                   "(default: the trainer's)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "moe.yaml"))
    p.add_argument("--quick", action="store_true", help="fewer samples and faster churn")
    add_arguments(p)
    p.add_argument("--log-dir", help="keep the programs' logs here (default: a temporary directory, removed)")
    args = p.parse_args()
    every, samples = defaults(args)
    report(run(args.config, every, samples, args.in_flight, log_dir=args.log_dir))


def defaults(args: argparse.Namespace) -> tuple[float, int]:
    return args.every or (12.0 if args.quick else 30.0), args.samples or (2000 if args.quick else 4800)


if __name__ == "__main__":
    main()
