"""The wire format of checkpoint transfer, shared by holders (serving.py) and fetchers (transfer.py).

One streaming RPC, ``CheckpointServer.rpc_read``, under the P2P namespace ``{run_id}_checkpoints``
(hivemind names an RPC after its servicer class, so that class name is part of the protocol).
The request is one ``ExpertRequest`` whose ``metadata`` is a msgpack map
``{"manifest_id": <64 hex>, "file": <"manifest.json" or a name the manifest lists>, "offset": <int>}``
(at most ``MAX_REQUEST_BYTES``). The reply is a stream of ``ExpertResponse`` frames: the first one's
``metadata`` is a msgpack map, ``{"ok": true, "size": <file size>, "offset": <offset>}`` or
``{"ok": false, "code": <code>, "error": <message>}``; after an ok header, every further frame's
``metadata`` holds the next 1 .. ``MAX_CHUNK_BYTES`` raw bytes of the file, up to its end.
Unknown request or header fields are ignored, so newer peers can add some.

Either side may end a transfer that stalls: a holder closes the stream of a fetcher that takes no
frame for a while (serving.py, ``ServingLimits.progress_timeout``), a fetcher leaves a holder that
sends nothing for a while (transfer.py, ``DEFAULT_IDLE_TIMEOUT``) for the next one.
"""

from __future__ import annotations

import msgpack

MIB = 2**20
MAX_CHUNK_BYTES = MIB  # one data frame; a server sends at most this, a fetcher refuses more
MAX_REQUEST_BYTES = 1024  # request metadata: an id, a file name of at most 255 characters, an offset
MAX_HEADER_BYTES = 4096  # reply header, error message included
MAX_ERROR_CHARS = 2000

# Error codes of a reply header. Peers must treat an unknown code like INTERNAL.
BAD_REQUEST = "bad_request"  # malformed, over a limit, or an offset past the end of the file
NOT_FOUND = "not_found"  # this peer holds no such checkpoint (any more), or the checkpoint no such file
BUSY = "busy"  # no transfer slot came free for this caller (all taken, or its share): try another holder, or later
INTERNAL = "internal"  # our copy is damaged or unreadable


def checkpoint_namespace(run_id: str) -> str:
    """The P2P namespace a run's checkpoints are served under."""
    return f"{run_id}_checkpoints"


def unpack_map(data: bytes) -> dict | None:
    """A request's or reply header's metadata as a dict; None if it is not a msgpack map."""
    try:
        meta = msgpack.unpackb(data, raw=False)
    except Exception:  # msgpack raises a zoo of types on garbage; all mean the same to us
        return None
    return meta if isinstance(meta, dict) else None

