"""swarm: decentralized, fault-tolerant training of Transformers by volunteers.

Map of the library, lowest layers first (``peer/`` and ``coordinator/`` are the programs built on it;
tests/unit/test_layers.py keeps every import going down these layers)::

    ``swarm.config``    typed run config, YAML round trip
    ``swarm.envflags``  every command-line flag also from an environment variable
    ``swarm.logs``      logging set-up for the programs
    ``swarm.metrics``   Prometheus metrics and the small HTTP server of every process
    ``swarm.healthcheck``  the container's HEALTHCHECK
    ``swarm.hivemind_internals``  every use of hivemind's private names, in one place
    ``swarm.threads``   which thread may change what: owners that mutators check (on in tests)
    ``swarm.tasks``     event loops that hold their tasks until done (asyncio holds them weakly)
    ``swarm.tenure``    how long this peer has watched another, and what that lets it believe
    ``swarm.zero``      ZeRO sharding of a stage's optimizer state: layout, ownership, chunk AdamW
    ``swarm.activations``  the activation cache: a forward's graph kept until its backward
    ``swarm.drain``     a due batch waiting briefly for the backwards of forwards run on its parameters
    ``swarm.delays``    how old the parameters of each counted sample's gradient were, against its step
    ``swarm.traffic``   bytes this peer sends, by what they carry
    ``swarm.model``     GPT blocks and the split into pipeline stages (no networking)
    ``swarm.data``      corpora, tokenization, deterministic batch sampling
    ``swarm.optim``     AdamW/NAdamW with warmup and cosine decay, gradient accumulation per stage
    ``swarm.state``     StageState: the owner of a stage replica's state
    ``swarm.dht``       signed, schema-checked DHT records over hivemind.DHT; the private swarm's RPC gate
    ``swarm.protocol``  the stage RPCs: wire format, limits, service and client
    ``swarm.averaging`` averaging among the servers of one stage
    ``swarm.checkpoint``  checkpoints of stages and runs: written, announced, fetched, verified
    ``swarm.routing``   the trainer's side of the pipeline: which server gets each call, retries, spot checks
    ``swarm.worker``    one compute thread a server runs its tasks on: bounded queue, how busy, how long a wait
    ``swarm.backend``   a stage's compute: forward, backward, accumulation, steps
    ``swarm.export``    a trained run as a Hugging Face GPT-2 model
    ``swarm.trainer``   a trainer: its share of the data, micro-batches in flight through the remote pipeline
    ``swarm.experts``   what an expert server computes: its experts and their optimizers
    ``swarm.reference`` the single-process reference trainer every swarm run is compared with
    ``swarm.serving``   the servers of a run (stage and expert servers) on one lifecycle
"""

__version__ = "0.1.0"
