"""How a DHT start that no initial peer answered is reported, and when it is tried once more."""

from __future__ import annotations

import pytest
from hivemind.utils.multiaddr import Multiaddr

import swarm.dht.node as node
from swarm.dht import BootstrapError

pytestmark = pytest.mark.timeout(30)

PEER = Multiaddr("/ip4/11.77.1.2/tcp/4000/p2p/QmRutfXqr9bCJ7Zjr8kFjR4DUxWpJRTsNXXiBu36jyeHuc")


def test_the_daemon_s_reason_is_in_the_line_unless_it_timed_out():
    quick = node._startup_error(RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a "
                                             "ping.\nmore"), [PEER], [], 30.0)
    assert isinstance(quick, BootstrapError) and quick.quick
    assert "(DHTNode bootstrap failed: none of the initial_peers responded to a ping.)" in str(quick)
    slow = node._startup_error(TimeoutError(), [PEER], [], 30.0)
    assert isinstance(slow, BootstrapError) and not slow.quick and "within 30s" in str(slow)


@pytest.mark.parametrize("failures, quick, starts, joined", [
    (1, True, 2, True),  # missed once: joined on the second start
    (2, True, 2, False),  # twice: given up (a dead address fails in seconds)
    (1, False, 1, False),  # a start that timed out is not tried again (it already took the whole wait)
])
def test_a_start_no_initial_peer_answered_at_once_is_tried_once_more(monkeypatch, failures, quick, starts, joined):
    calls = []

    def start_once(*args):
        calls.append(args)
        if len(calls) <= failures:
            error = BootstrapError("none of the initial peers answered")
            error.quick = quick
            raise error
        return "dht"

    monkeypatch.setattr(node, "_start_dht_once", start_once)
    monkeypatch.setattr(node, "BOOTSTRAP_RETRY_PAUSE", 0.0)
    if joined:
        assert node._start_dht_joined("args") == "dht"
    else:
        with pytest.raises(BootstrapError):
            node._start_dht_joined("args")
    assert len(calls) == starts
