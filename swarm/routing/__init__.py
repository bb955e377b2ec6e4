"""swarm.routing: the trainer side of the pipeline.

- ``balancer``  which server of a stage gets the next call: the one where it should finish first,
                given the work this trainer has outstanding there and each server's measured time
                per sample and request kind; bans with exponential backoff; servers missing from a
                lookup remembered for a while (pure logic, no I/O)
- ``pipeline``  RemotePipeline: one micro-batch's forward, loss and backward across the stage
                servers, retrying failed calls on other servers of the stage; hands each call's
                balancer ticket back once, however the call ends; an error reply of any code is that
                server's failure
- ``inflight``  how many micro-batches a trainer keeps in flight: enough to cover the round trips it
                measures, within a batch's worth
- ``experts``   a stage server's side of remote experts: which host runs each expert's tokens, and what
                happens when hosts fail or are slow
- ``pings``     round trips a trainer times to each server (a DHT ping), which its balancers count for an
                untried server's calls, one per stream window they carry
- ``spot_checks``  replies checked against witnesses of the same stage (every probe, 1 in 32 others);
                the server the other two disagree with is banned
"""

from swarm.routing.balancer import StageBalancer, Ticket
from swarm.routing.pipeline import PipelineError, PipelineSettings, PipelineStats, RemotePipeline

__all__ = ["PipelineError", "PipelineSettings", "PipelineStats", "RemotePipeline", "StageBalancer", "Ticket"]
