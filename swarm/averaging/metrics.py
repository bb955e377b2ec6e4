"""Prometheus metrics of a stage's averaging rounds and state downloads."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from swarm.traffic import TRAFFIC

SUCCEEDED, FAILED, LOCAL = "succeeded", "failed", "local"  # outcomes of a round
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
START_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class AveragingMetrics:
    """One set per registry: every metric is labelled by stage."""

    def __init__(self, registry: CollectorRegistry, stage: int):
        self.sent_bytes = 0  # what bytes_sent counts
        label = str(stage)
        # first in the registry, so a scrape counts what was sent since the last round before it reads the counter
        self.before_scrape: Callable[[], None] | None = None
        registry.register(_BeforeScrape(self))
        rounds = Counter("swarm_averaging_rounds", "Optimizer steps by how their gradient was made: averaged "
                         "with peers (succeeded), local after a failed round (failed), local with no peer (local)",
                         ["stage", "outcome"], registry=registry)
        self.rounds = {outcome: rounds.labels(stage=label, outcome=outcome) for outcome in (SUCCEEDED, FAILED, LOCAL)}
        self.retried = Counter("swarm_averaging_retried_rounds", "Failed rounds whose samples went back to try again "
                               "at the same step (the stage's other servers most likely failed it too)", ["stage"],
                               registry=registry).labels(stage=label)
        self.group_size = Gauge("swarm_averaging_group_size", "Servers in the last successful averaging round",
                                ["stage"], registry=registry).labels(stage=label)
        self.bytes_sent = Counter("swarm_averaging_bytes_sent", "Bytes this server sent in averaging rounds (the "
                                  "all-reduce's messages, or the ZeRO-sharded collective's)", ["stage"],
                                  registry=registry).labels(stage=label)
        self.round_seconds = Histogram("swarm_averaging_round_seconds", "Time from the start of matchmaking to "
                                       "the end of the all-reduce, failed rounds included", ["stage"],
                                       buckets=ROUND_BUCKETS, registry=registry).labels(stage=label)
        downloads = Counter("swarm_averaging_state_downloads", "Downloads of the stage's state from its peers "
                            "(joining, or catching up)", ["stage", "outcome"], registry=registry)
        self.fingerprint = Gauge("swarm_averaging_param_fingerprint", "Sum and sum of squares of the stage's "
                                 "parameters: equal on replicas in sync", ["stage", "part"], registry=registry)
        self.in_round = Gauge("swarm_averaging_round_in_progress", "1 while this server takes part in an "
                              "averaging round", ["stage"], registry=registry).labels(stage=label)
        self.round_start_seconds = Histogram(
            "swarm_averaging_round_start_seconds", "Time from this server handing its batch to a round until its "
            "part of the all-reduce began (at once when the group formed ahead)", ["stage"], buckets=START_BUCKETS,
            registry=registry).labels(stage=label)
        self.compute_seconds = Counter(
            "swarm_averaging_compute_seconds", "Time the stage's compute thread spent on averaging's behalf "
            "(closing a batch, applying a step or a downloaded state) instead of serving requests; it never "
            "waits on the network", ["stage"], registry=registry).labels(stage=label)
        self.late_samples = Counter(
            "swarm_averaging_late_samples", "Samples this server took while a round ran beside compute: their "
            "gradient, of the parameters before that round's step, counts towards the step after it (one step "
            "late)", ["stage"], registry=registry).labels(stage=label)
        self.dropped_samples = Counter(
            "swarm_averaging_dropped_samples", "Samples accumulated or held towards a step when a state downloaded "
            "from a peer replaced this replica's: their gradient, of the replaced parameters, is dropped",
            ["stage"], registry=registry).labels(stage=label)
        self.rejected_states = Counter(
            "swarm_averaging_rejected_states", "States a peer sent that failed their checks (shapes, dtypes, "
            "non-finite values, a step or parameters the stage's progress does not back); the peer is not asked "
            "again for a while", ["stage"], registry=registry).labels(stage=label)
        self.optimizer_state_bytes = Gauge(
            "swarm_optimizer_state_bytes", "Bytes of optimizer state (AdamW moments) this server holds, sharded "
            "(averaging.zero) or not", ["stage"], registry=registry).labels(stage=label)
        self.chunks_owned = Gauge("swarm_zero_chunks_owned", "Chunks of the stage's optimizer state whose "
                                  "moments this server holds (averaging.zero)", ["stage"],
                                  registry=registry).labels(stage=label)
        transfers = Counter("swarm_zero_chunk_transfers", "Chunks' moments handed to a new owner (a member joined "
                            "or left), by direction", ["stage", "direction"], registry=registry)
        self.chunk_transfers = {d: transfers.labels(stage=label, direction=d) for d in ("sent", "received")}
        self.chunks_reinitialized = Counter(
            "swarm_zero_chunks_reinitialized", "Chunks of the optimizer state whose every owner left: their moments "
            "started again from zero", ["stage"], registry=registry).labels(stage=label)
        armed = Counter("swarm_averaging_groups_armed", "Rounds by when their group began to form: ahead (while "
                        "the batch filled, so the round starts as soon as every member closed its batch) or now "
                        "(when this server closed its batch)", ["stage", "when"], registry=registry)
        self.armed_rounds = {when: armed.labels(stage=label, when=when) for when in ("ahead", "now")}
        self.downloads = {outcome: downloads.labels(stage=label, outcome=outcome) for outcome in (SUCCEEDED, FAILED)}

    def sent(self, nbytes: int) -> None:
        """Bytes this server sent in an averaging round: this stage's counter and the peer's traffic."""
        self.sent_bytes += nbytes  # (read without a registry scan: a server's record)
        self.bytes_sent.inc(nbytes)
        TRAFFIC.add("averaging", nbytes)


class _BeforeScrape:
    """A collector of no metric that runs `metrics.before_scrape` when the registry is read (a scrape, or
    get_sample_value): the all-reduce's bytes are counted in the averaging process, and its last answers
    to the other members go after this member's round returned."""

    def __init__(self, metrics: AveragingMetrics):
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        if self.metrics.before_scrape is not None:
            self.metrics.before_scrape()
        return []
