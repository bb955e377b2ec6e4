"""Errors of stage averaging."""


class AveragingError(RuntimeError):
    """Base of the errors below."""


class StateDownloadError(AveragingError):
    """A server could not download its stage's state from the stage's other servers."""


class StateMismatch(AveragingError):
    """A downloaded state does not fit this stage (other model, other stage, corrupt)."""
