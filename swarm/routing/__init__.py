"""swarm.routing: the trainer side of the pipeline.

- ``balancer``  which server of a stage gets the next call: least accumulated virtual time, bans
                with exponential backoff (pure logic, no I/O)
- ``pipeline``  RemotePipeline: one micro-batch's forward, loss and backward across the stage
                servers, retrying failed calls on other servers of the stage
"""

from swarm.routing.balancer import StageBalancer
from swarm.routing.pipeline import PipelineError, PipelineSettings, PipelineStats, RemotePipeline

__all__ = ["PipelineError", "PipelineSettings", "PipelineStats", "RemotePipeline", "StageBalancer"]
