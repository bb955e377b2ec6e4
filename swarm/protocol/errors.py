"""Every exception swarm.protocol raises, and the short error codes that travel in error replies."""

from __future__ import annotations

# Codes a server puts in `{"ok": false, "code": ...}`. Peers must treat an unknown code like INTERNAL.
BAD_REQUEST = "bad_request"  # the request was malformed, over a limit, or sent to the wrong endpoint
NOT_READY = "not_ready"  # the server cannot serve yet (still joining, loading state, ...): try elsewhere
WRONG_STAGE = "wrong_stage"  # the server does not host the stage the request names
INTERNAL = "internal"  # the handler failed in a way the caller could not have caused on purpose
BUSY = "busy"  # the server is taking in as many requests at once as it allows: try elsewhere or later


class StageRPCError(Exception):
    """Base of all swarm.protocol errors: catching it covers every way a stage call can fail."""


class ProtocolError(StageRPCError):
    """Bytes or metadata that break the wire format or its limits (malformed, truncated, too large)."""


class RequestRejected(StageRPCError):
    """Raised by a stage handler to refuse a request with a specific code (e.g. NOT_READY, WRONG_STAGE)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class RemoteStageError(StageRPCError):
    """The server answered with an error reply; `code` says why (one of the codes above, or a newer one)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"[{code}] {message}")
        self.code, self.message = code, message


class StageUnavailable(StageRPCError):
    """The server could not be reached, broke the connection, or did not answer in time: retry elsewhere."""


class DialHeldOff(StageUnavailable):
    """Our own p2p daemon did not try to reach the server: a dial to it moments ago did not complete (another
    call's, perhaps one given up by its caller's timeout), and libp2p holds off redialing an address for a few
    seconds after that. No word on the server itself."""
