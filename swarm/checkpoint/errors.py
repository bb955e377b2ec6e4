"""The one exception of the checkpoint subsystem; its message names the file and says what is wrong."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint is missing, broken, or not for us (another run, stage or model shape)."""


class CheckpointExists(CheckpointError):
    """A checkpoint of that step is already in place, and this kind is never replaced in place (run checkpoints)."""
