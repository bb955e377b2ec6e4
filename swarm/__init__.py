"""swarm: decentralized, fault-tolerant training of Transformers by volunteers.

Map of the library (``peer/`` and ``coordinator/`` are the programs built on it):

- ``swarm.config``   typed run config, YAML round trip
- ``swarm.model``    GPT blocks and the split into pipeline stages (no networking)
- ``swarm.data``     corpora, tokenization, deterministic batch sampling
- ``swarm.optim``    AdamW with warmup and cosine decay, gradient accumulation per stage
- ``swarm.reference`` the single-process reference trainer every swarm run is compared with
- ``swarm.dht``      signed, schema-checked DHT records over hivemind.DHT
- ``swarm.averaging`` averaging among the servers of one stage
"""

__version__ = "0.1.0"
