"""The model and its split into pipeline stages; no networking here (servers wrap it from outside).

Map:

- ``gpt.py``     the GPT decoder as parts: :class:`Embedding`, :class:`Block`, :class:`Head`, each
  made by a ``make_*`` function from its own seeded generator, so any part can be built alone;
  :class:`GPT` chains them in one process. Input checks (``check_tokens`` ...) live here too.
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
    make_head,
)
from swarm.model.stages import StageModule, build_stage, build_stages, split_model, stage_layers

__all__ = [
    "GPT",
    "Block",
    "Embedding",
    "Head",
    "StageModule",
    "build_stage",
    "build_stages",
    "check_hidden",
    "check_targets",
    "check_tokens",
    "make_block",
    "make_embedding",
    "make_head",
    "split_model",
    "stage_layers",
]
