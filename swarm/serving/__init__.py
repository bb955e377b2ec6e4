"""Serving: the servers of a run, stage servers and expert servers, on one lifecycle.

Map of the package::

    lifecycle.py   ServerLifecycle: JOINING -> ONLINE -> OFFLINE, the announce loop, the ordered shutdown
                   (OFFLINE announced, services unregistered, then the server's own teardown)
    stage.py       StageServer (ServerOptions): hosts one pipeline stage; StageRequestHandler
    expert.py      ExpertServer (ExpertOptions): hosts experts of a run's MoE blocks; ExpertRequestHandler;
                   each hosted expert's checkpoints kept by a swarm.checkpoint StageKeeper (part "expert")
    replicas.py    ExpertReplicas: the hosts of one expert average its parameters every period, and a host
                   joining it downloads its state from one of them
    handler.py     CountingHandler (what both handlers share: run on the worker, count every outcome);
                   wrappers around any handler: FaultInjection (--inject-delay, --inject-failure-rate),
                   InFlight; serve(...) registers a handler
    backwards.py   RecentBackwards: the retried-backward cache (a retry is answered from the first run)
    throughput.py  what a server announces as its speed: stage_throughput, expert_throughput
    placement.py   which stage a joining server takes (choose_stage), which experts (choose_experts); pure
    rebalance.py   whether a stage server moves to another stage (plan_move, pure; Rebalancer: the checks)
    metrics.py     ServerMetrics, ExpertMetrics and their collectors, reading narrow views, not the servers

Concurrency map of a stage server (what runs where, what it may touch, how work is handed to it)::

    main thread        start(): builds the stage, loads its state (peers, checkpoint), then hands the
                       StageState to the compute thread (StageBackend.hand_over); shutdown()
    swarm loop         BackgroundLoop: asyncio; the stage RPCs (StageRequestHandler coroutines), the
                       progress channel, checkpoint serving; never touches the state: hands requests to
                       the compute thread with backend.submit (awaited as futures)
    compute thread     the backend's Worker: forward, backward, accumulation, and everything that changes
                       the StageState (steps, look-ahead, adopting a downloaded state, the round it is at);
                       its owner once handed over: a mutator on any other thread raises WrongThread where
                       SWARM_CHECK_THREADS=1 (swarm.threads; the tests set it)
    averaging{k}       StageAverager's job thread: a round's network part (Round.run: matchmaking and
                       the all-reduce through the averaging process, or the sharded collective), a
                       catch-up's download (CatchUp.run), groups formed ahead (GroupsAhead.form); reads
                       what the compute thread handed it, returns a function the compute thread applies
                       (StageStepper.step); the phase (StageAverager.enter) changes on the compute thread,
                       but for solo, entered wherever the dead averaging process is noticed
    progress:<key>     StageProgressTracker: publishes this server's progress to the DHT, reads the stage's
                       (reads the state under StageState.lock)
    announcer          ServerLifecycle: renews the record; a stage's expert hosts looked up, kept graphs
                       expired (handed to the compute thread with backend.submit)
    checkpoint{k}, checkpoints, sha256
                       StageKeeper: writes the copy the compute thread made after a step (never the live
                       state), announces what it holds; a hashing thread per write
    metrics-http       Prometheus scrapes: collectors read narrow views (metrics.py), counters only
    state downloads    hivemind's averaging process asks for the state on a thread of its own, which reads
                       it under StageState.lock (CatchUp.state_for_peer)
    processes          the DHT and averaging processes (forked by hivemind) and p2pd

An expert server has the same main thread, loop, announcer and metrics; its ExpertHost's worker thread
does every forward, backward and step of the hosted experts, copies an expert's state for its keeper
right after a step (ExpertServer.backward) and for a joiner, and applies what an averaging round moved
(ExpertReplicas and hivemind's state download thread hand work to it with host.submit). The main
thread loads the experts' states (a live host's, or a checkpoint) before it hands the host's
optimizers to that thread (ExpertHost.owner). Beside it: replicas{e} (ExpertReplicas' rounds, one
thread and one averaging process per hosted expert, forked side by side at start) and each expert's
StageKeeper writer thread; the announcer renews the keepers' records (ExpertServer._tick).

Both sides of a wire contract take its limits from one place (swarm.protocol.RequestLimits), checkpoints
are due by one rule (swarm.checkpoint.schedule), and ONLINE records are found by one function
(swarm.dht.online).
"""

from swarm.serving.expert import ExpertOptions, ExpertServer
from swarm.serving.placement import choose_experts, choose_stage
from swarm.serving.stage import ServerOptions, StageServer, StageStateMissing
from swarm.serving.throughput import expert_throughput, stage_throughput

__all__ = [
    "ExpertOptions",
    "ExpertServer",
    "ServerOptions",
    "StageServer",
    "StageStateMissing",
    "choose_experts",
    "choose_stage",
    "expert_throughput",
    "stage_throughput",
]
