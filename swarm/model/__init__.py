"""The model and its split into pipeline stages; no networking here (servers wrap it from outside).

Map:

- ``gpt.py``     the GPT decoder as parts: :class:`Embedding`, :class:`Block`, :class:`Head`, each
  made by a ``make_*`` function from its own seeded generator, so any part can be built alone;
  :class:`GPT` chains them in one process. Input checks (``check_tokens`` ...) live here too.
- ``moe.py``     the mixture-of-experts FFN (:class:`MoEFeedForward`) and its pure routing math
  (``route``, ``gates``, ``aux_loss``, ``combine``); MoE blocks report their aux losses through
  :func:`record_moe`. :func:`make_expert` (gpt.py) builds one expert alone, equal to the block's.
- ``stages.py``  :class:`StageModule`, one contiguous slice of the GPT; :func:`split_model` cuts a
  built model (sharing modules), :func:`build_stage` builds one stage alone, equal to that slice.
"""

from swarm.model.gpt import (
    GPT,
    Block,
    Embedding,
    Head,
    check_hidden,
    check_targets,
    check_tokens,
    make_block,
    make_embedding,
    make_expert,
    make_head,
)
from swarm.model.moe import Expert, MoEFeedForward, MoERecord, RoutingPlan, record_moe, total_aux_loss
from swarm.model.stages import StageModule, build_stage, build_stages, split_model, stage_layers

__all__ = [
    "GPT",
    "Block",
    "Embedding",
    "Expert",
    "Head",
    "MoEFeedForward",
    "MoERecord",
    "RoutingPlan",
    "StageModule",
    "build_stage",
    "build_stages",
    "check_hidden",
    "check_targets",
    "check_tokens",
    "make_block",
    "make_embedding",
    "make_expert",
    "make_head",
    "record_moe",
    "split_model",
    "stage_layers",
    "total_aux_loss",
]
