"""The one exception of the checkpoint subsystem; its message names the file and says what is wrong."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint is missing, broken, or not for us (another run, stage or model shape)."""
