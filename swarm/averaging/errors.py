"""Errors of stage averaging."""


class AveragingError(RuntimeError):
    """Base of the errors below."""


class StateDownloadError(AveragingError):
    """A server could not download its stage's state from the stage's other servers."""

