"""The `swarm-peer` program: join a run as a stage server, an expert server or a trainer.

- ``cli``        flags (each also an environment variable), joining, the role's main loop

The servers and the trainer it runs are the library's (swarm.serving, swarm.trainer).
"""
