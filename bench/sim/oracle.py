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
    """The oracle's choice: the ONLINE server the trainer knows of (its last lookup), not among `exclude` and that
    would take the call now (room in its queue, no refusal by time; the stage's only server takes a patient call),
    that would answer it first, counting what is already on its way to it; charged to the trainer's balancer so
    that timeouts and reports work as for its own choice. (None, False) if there is none; else (the ticket,
    whether the call is patient), as a trainer's own call would be. Sending a call to the best server however long
    it would wait there, when none would take it now, was tried and not kept (README, Refusing by time)."""
    s = trainer.swarm.s
    n, last = s.micro_batch, stage == s.stages - 1
    listed = trainer.balancers[stage].listed()
    patient = len(listed) == 1
    best, best_finish = None, math.inf
    for c in trainer.swarm.online(stage):
        if c.peer_id in exclude or c.peer_id not in listed or trainer.swarm.full(c, patient):
            continue
        work = 1.0 if kind == FORWARD else (3.0 if last or c.peer_id != prefer else 2.0)
        done = finish_on(trainer, c, up, down, work, incoming=True)
        if done < best_finish:
            best, best_finish = c, done
    return (None, False) if best is None else (trainer.balancers[stage].charge(best.peer_id, n, kind), patient)
