"""The simulator's oracle of routing: when a call would be answered on a server, knowing everything now, and the
server an oracle would send it to (Scenario.oracle_routing), beside the trainers' own StageBalancers."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from swarm.protocol import FORWARD
from swarm.routing.balancer import Ticket

if TYPE_CHECKING:
    from bench.sim.servers import Server
    from bench.sim.swarm import Trainer


def finish_on(trainer: Trainer, candidate: Server, up: float, down: float, work: float,
              incoming: bool = False) -> float:
    """When a call of `trainer` (`up` bytes there, `down` back, `work` units of a sample's forward) would be
    answered on `candidate`, knowing its queue, speed and links now (and, with `incoming`, the work on its way)."""
    s, now, net = trainer.swarm.s, trainer.swarm.sim.now, trainer.swarm.net
    _, there = net.delivery(trainer.link, candidate.link, up, after=s.call_overhead)
    backlog = candidate.backlog(now) + (candidate.incoming if incoming else 0.0)
    done = max(there, now + backlog) + s.micro_batch * s.seconds_per_sample * work / candidate.speed
    return done + net.transit(candidate.link, trainer.link, down)[1]  # (its uplink taken as free)


def oracle_ticket(trainer: Trainer, stage: int, kind: str, exclude: tuple, prefer: str | None, up: float,
                  down: float) -> tuple[Ticket | None, bool]:
    """The oracle's choice: the ONLINE server the trainer knows of (its last lookup), not among `exclude`, that
    would answer the call first, counting what is already on its way to it, among those that would take it now
    (room in the queue, no refusal by time); if none would, the one answering first among those with room, asked
    to wait (patient). Charged to the trainer's balancer so that timeouts and reports work as for its own choice.
    (None, False) if there is none."""
    s = trainer.swarm.s
    n, last = s.micro_batch, stage == s.stages - 1
    best: dict[bool, tuple[float, Server | None]] = {False: (math.inf, None), True: (math.inf, None)}
    listed = set(trainer.balancers[stage].listed())
    for c in trainer.swarm.online(stage):
        if c.peer_id in exclude or c.peer_id not in listed or trainer.swarm.full(c, patient=True):
            continue
        work = 1.0 if kind == FORWARD else (3.0 if last or c.peer_id != prefer else 2.0)
        done = finish_on(trainer, c, up, down, work, incoming=True)
        patient = trainer.swarm.full(c)
        if done < best[patient][0]:
            best[patient] = (done, c)
    patient = best[False][1] is None
    chosen = best[patient][1]
    return (None, False) if chosen is None else (trainer.balancers[stage].charge(chosen.peer_id, n, kind), patient)
