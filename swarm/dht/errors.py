"""Exceptions of the DHT subsystem; each message is one line a volunteer can act on."""

from __future__ import annotations


class SwarmDHTError(Exception):
    """Base class of every error raised by ``swarm.dht``."""


class InvalidMultiaddr(SwarmDHTError, ValueError):
    """A multiaddr given by a person (a flag, an env variable) does not parse or lacks a part we need."""


class BootstrapError(SwarmDHTError):
    """None of the initial peers answered, so this peer could not join the swarm."""

    quick = False  # it failed at once (not by running out of time): a start worth trying once more


class RunConfigNotFound(SwarmDHTError):
    """No run config signed by the expected coordinator is visible in the DHT (yet).

    `others` are the peer ids of whoever else publishes one for the run (a coordinator restarted
    with a new identity, or a stranger): never trusted in the coordinator's place.
    """

    def __init__(self, message: str, others: tuple[str, ...] = ()):
        super().__init__(message)
        self.others = others


class RunConfigInvalid(SwarmDHTError):
    """The coordinator's run config record was found but cannot be used (bad YAML, wrong run id)."""


class DHTRequestTimeout(SwarmDHTError, TimeoutError):
    """A DHT get/store or a peer RPC did not finish within its timeout."""


class DHTProcessGone(SwarmDHTError):
    """This peer's DHT process is no longer running: nothing can be stored or read through it."""
