"""Run-level programs: `swarm-coordinator` (bootstraps a run) and `swarm-local` (a whole swarm here).

Map::

    cli.py          `swarm-coordinator`: bootstraps a run's DHT and publishes its signed run config
    node.py         the coordinator's node: DHT bootstrap, the signed run config, the swarm's status
    status.py       the coordinator's view of the swarm from DHT records: `/status` JSON, swarm-wide gauges
    archive.py      RunArchive: the coordinator's full-model checkpoints
    discovery.py    Prometheus HTTP service discovery: every peer announcing a metrics address is a target
    ``web``         the live page for people: `/`, its static files, the history its charts draw
    local.py        `swarm-local`: a whole swarm on this machine, or the single-process reference trainer
    local_swarm.py  that swarm: coordinator, stage servers and trainers as separate processes
    launcher.py     child processes of `swarm-local`: start them, read what they print, end them all
    ports.py        metrics ports for processes started here, below the kernel's ephemeral range (and the tests')
    progress.py     progress for people: one line per update, or a live line on a terminal
"""
