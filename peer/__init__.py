"""The `swarm-peer` program: join a run as a stage server or a trainer.

- ``cli``        flags (each also an environment variable), joining, the role's main loop
- ``placement``  which stage a new server takes (pure logic)
- ``server``     a stage server: RPC handler, DHT announcements, metrics
- ``trainer``    a trainer: data, micro-batches in flight through the remote pipeline, metrics
"""
