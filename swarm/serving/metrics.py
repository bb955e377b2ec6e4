"""Servers' Prometheus metrics: request counters and histograms, and collectors that read the activation
cache, the MoE blocks' routing and expert calls, and the hosted experts when Prometheus scrapes.

Collectors read narrow views (a function returning the stage's backend, its expert dispatcher, an expert
host; None before there is one), never the server object itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

View = Callable[[], Any]  # returns the object read now, or None


class ServerMetrics:
    """A stage server's metrics. `backend`: its StageBackend now; `dispatcher`: its ExpertDispatcher now."""

    def __init__(self, registry: CollectorRegistry, backend: View, dispatcher: View):
        self.requests = Counter("swarm_server_requests_total", "Requests by kind and outcome", ["kind", "status"],
                                registry=registry)
        self.latency = Histogram("swarm_server_request_seconds", "Time to answer a request", ["kind"],
                                 registry=registry)
        self.samples = Counter("swarm_server_samples_total", "Samples whose backward this server ran",
                               registry=registry)
        Gauge("swarm_server_queue_depth", "Tasks waiting for or in compute", registry=registry).set_function(
            lambda: backend().queue_depth if backend() else 0)
        Gauge("swarm_server_step", "Optimizer steps of this stage replica", registry=registry).set_function(
            lambda: backend().step if backend() else 0)
        Gauge("swarm_server_utilization_ratio", "Share of the last 30 s the stage's compute thread was busy "
              "(requests, and applying steps)", registry=registry).set_function(
            lambda: backend().utilization() if backend() else 0.0)
        self.throughput = Gauge("swarm_server_throughput_samples_per_second", "Announced throughput",
                                registry=registry)
        self.wait_limit = Gauge("swarm_server_wait_limit_seconds", "Seconds of queued work past which a request "
                                "whose caller could go elsewhere is refused (max_wait, or auto_max_wait; 0: never)",
                                registry=registry)
        self.staleness = Histogram(
            "swarm_server_backward_staleness_steps",
            "Optimizer steps this stage took between a micro-batch's forward and its backward (0: exact)",
            buckets=(0, 1, 2, 4, 8, 16), registry=registry)
        self.stashed = Counter("swarm_server_stashed_samples", "Samples whose gradient was computed on the "
                               "parameters from before the stage's last step, which their forward used",
                               registry=registry)
        self.recomputed_elsewhere = Counter(
            "swarm_server_recomputed_elsewhere", "Backwards whose forward another replica ran (low-communication "
            "mode: their gradient counts for averaging.recomputed_weight)", registry=registry)
        self.in_flight = Gauge("swarm_server_requests_in_flight", "Requests being answered now", ["kind"],
                               registry=registry)
        self.expert_latency = Histogram("swarm_moe_expert_call_seconds", "Time for an expert server to answer a "
                                        "request of this stage", ["layer", "kind"], registry=registry)
        registry.register(ComputeCollector(backend))
        registry.register(ActivationCacheCollector(backend))
        registry.register(ExpertCollector(backend))
        registry.register(ExpertCallCollector(backend, dispatcher, self.expert_latency))


class ExpertCollector:
    """Per MoE block of the stage: tokens routed to each expert, and slots dropped over capacity."""

    def __init__(self, backend: View):
        self.backend = backend

    def collect(self):
        tokens = CounterMetricFamily("swarm_moe_expert_tokens", "Tokens of trained micro-batches each expert "
                                     "processed (its load)", labels=["layer", "expert"])
        dropped = CounterMetricFamily("swarm_moe_dropped_slots", "Top-k slots of trained micro-batches dropped "
                                      "for being over an expert's capacity (the token kept its residual)",
                                      labels=["layer"])
        backend = self.backend()
        if backend is not None:
            for layer, counts in list(backend.expert_tokens.items()):
                for expert, count in enumerate(counts):
                    tokens.add_metric([str(layer), str(expert)], count)
                dropped.add_metric([str(layer)], backend.dropped_slots[layer])
        yield from (tokens, dropped)


class ExpertCallCollector:
    """Per MoE block whose experts live on expert servers: calls to them, failures, and what was lost."""

    def __init__(self, backend: View, dispatcher: View, latency: Histogram):
        self.backend, self.dispatcher, self.latency = backend, dispatcher, latency

    def collect(self):
        calls = CounterMetricFamily("swarm_moe_expert_calls", "Requests sent to expert servers",
                                    labels=["layer", "kind"])
        failures = CounterMetricFamily("swarm_moe_expert_call_failures", "Requests to expert servers that failed "
                                       "or timed out (each banned the host for those experts)",
                                       labels=["layer", "kind"])
        lost = CounterMetricFamily("swarm_moe_unavailable_slots", "Top-k slots whose expert no host answered in "
                                   "time: the token went on without it", labels=["layer"])
        backward_lost = CounterMetricFamily("swarm_moe_backward_lost_experts", "Experts whose tokens got no "
                                            "gradient in a backward: no host took it", labels=["layer"])
        latency = self.latency
        dispatcher = self.dispatcher()
        if dispatcher is not None:
            stats = dispatcher.stats
            for (layer, kind), count in list(stats.calls.items()):
                calls.add_metric([str(layer), kind], count)
                failures.add_metric([str(layer), kind], stats.failures.get((layer, kind), 0))
            for layer in self.backend().module.moe_layers:
                lost.add_metric([str(layer)], stats.lost_slots.get(layer, 0))
                backward_lost.add_metric([str(layer)], stats.backward_lost.get(layer, 0))
            while stats.latency:  # observed here, off the hot path
                layer, kind, seconds = stats.latency.pop()
                latency.labels(layer=str(layer), kind=kind).observe(seconds)
        yield from (calls, failures, lost, backward_lost)


class ComputeCollector:
    """CPU seconds of the stage's compute thread, read when Prometheus scrapes: what a server spends outside it
    (RPCs, the DHT, averaging, p2pd) is its process' CPU time minus this (bench/scaling.py)."""

    def __init__(self, backend: View):
        self.backend = backend

    def collect(self):
        backend = self.backend()
        family = CounterMetricFamily("swarm_server_compute_cpu_seconds",
                                     "CPU seconds the stage's compute thread spent on requests and steps")
        family.add_metric([], backend.cpu_seconds if backend is not None else 0.0)
        yield family
        ahead = CounterMetricFamily("swarm_server_forwards_ahead", "Forwards run on the parameters the stage's "
                                    "next step is predicted to make, their backward due after that step; on "
                                    "the last stage, calls that came while its batch was due "
                                    "(optimizer.lookahead)")
        ahead.add_metric([], backend.forwards_ahead if backend is not None else 0)
        yield ahead
        delays = CounterMetricFamily("swarm_server_gradient_delay_samples",
                                     "Samples counted in a step, by the steps their gradient's parameters were "
                                     "behind that step's (0 fresh, -1 a prediction a step early) and whether they ran "
                                     "ahead on a prediction (swarm.delays)", labels=["behind", "ahead"])
        for (ran_ahead, behind), n in sorted(backend.delays.samples.items() if backend is not None else []):
            delays.add_metric([str(behind), str(ran_ahead).lower()], n)
        yield delays


class ActivationCacheCollector:
    """The activation cache's counters, read when Prometheus scrapes (the cache itself stays lock-free)."""

    def __init__(self, backend: View):
        self.backend = backend

    def collect(self):
        backend = self.backend()
        cache = backend.cache if backend is not None else None
        values = (0, 0, 0, 0, 0) if cache is None else (cache.hits, cache.misses, cache.evictions,
                                                         cache.bytes_held, len(cache))
        for name, doc, value in zip(("hits", "misses", "evictions"), (
                "Backwards served from the forward's kept graph",
                "Backwards that recomputed the forward (graph evicted, expired, never kept, or stale)",
                "Kept forward graphs dropped before their backward came (for room or age)"), values):
            family = CounterMetricFamily(f"swarm_activation_cache_{name}", doc)
            family.add_metric([], value)
            yield family
        held = GaugeMetricFamily("swarm_activation_cache_bytes", "Activation memory held by kept forward graphs")
        held.add_metric([], values[3])
        yield held
        entries = GaugeMetricFamily("swarm_activation_cache_entries", "Forward graphs kept for their backward")
        entries.add_metric([], values[4])
        yield entries


class ExpertMetrics:
    """An expert server's metrics. `host`: its ExpertHost now."""

    def __init__(self, registry: CollectorRegistry, host: View):
        self.requests = Counter("swarm_expert_requests_total", "Expert requests by kind and outcome",
                                ["kind", "status"], registry=registry)
        self.latency = Histogram("swarm_expert_request_seconds", "Time to answer an expert request", ["kind"],
                                 registry=registry)
        self.replica_rounds = Counter("swarm_expert_replica_rounds_total", "Averaging rounds of a hosted expert "
                                      "with its other hosts (swarm.serving.replicas)", ["expert", "outcome"],
                                      registry=registry)
        Gauge("swarm_expert_step", "Optimizer steps of the hosted experts", registry=registry).set_function(
            lambda: host().step if host() else 0)
        Gauge("swarm_expert_queue_depth", "Tasks waiting for or in compute", registry=registry).set_function(
            lambda: host().queue_depth if host() else 0)
        registry.register(HostedTokensCollector(host))


class HostedTokensCollector:
    """Tokens each hosted expert ran a backward on."""

    def __init__(self, host: View):
        self.host = host

    def collect(self):
        family = CounterMetricFamily("swarm_expert_tokens", "Tokens each hosted expert ran a backward on",
                                     labels=["layer", "expert"])
        host = self.host()
        if host is not None:
            for (layer, e), count in list(host.tokens.items()):
                family.add_metric([str(layer), str(e)], count)
        yield family
