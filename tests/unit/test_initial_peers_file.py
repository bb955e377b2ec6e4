"""`--initial-peers @FILE` and `--initial-peers-file`: how compose hands the coordinator's multiaddrs around."""

from __future__ import annotations

import threading

import pytest

from swarm.dht import BootstrapError, read_initial_peers, write_initial_peers
from swarm.dht.bootstrap import MAX_INITIAL_PEERS_FILE

MADDRS = ["/ip4/127.0.0.1/tcp/1/p2p/QmA", "/ip4/127.0.0.1/tcp/2/p2p/QmB"]


def test_a_written_file_is_read_back_among_plain_multiaddrs(tmp_path):
    path = tmp_path / "initial-peers"
    write_initial_peers(path, MADDRS)
    assert read_initial_peers(["/ip4/10.0.0.1/tcp/3/p2p/QmC", f"@{path}"], timeout=1) == \
        ["/ip4/10.0.0.1/tcp/3/p2p/QmC", *MADDRS]
    assert [p.name for p in tmp_path.iterdir()] == ["initial-peers"]  # no temporary file left


def test_the_file_is_waited_for_until_it_appears(tmp_path):
    path = tmp_path / "initial-peers"
    looks = []

    def pause(seconds: float) -> bool:  # the coordinator writes the file after the peer's second look
        looks.append(seconds)
        if len(looks) == 2:
            write_initial_peers(path, MADDRS)
        return False

    assert read_initial_peers([f"@{path}"], timeout=30, stop=pause) == MADDRS
    assert len(looks) == 2


def test_a_missing_file_fails_clearly_after_the_timeout_or_at_stop(tmp_path):
    with pytest.raises(BootstrapError, match="did not appear within 0s"):
        read_initial_peers([f"@{tmp_path / 'nothing'}"], timeout=0)
    stopped = threading.Event()
    stopped.set()
    with pytest.raises(BootstrapError, match="did not appear"):
        read_initial_peers([f"@{tmp_path / 'nothing'}"], timeout=60, stop=stopped.wait)


def test_empty_and_oversized_files_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(BootstrapError, match="lists no multiaddr"):
        read_initial_peers([f"@{empty}"], timeout=1)
    big = tmp_path / "big"
    big.write_text("x" * (MAX_INITIAL_PEERS_FILE + 1))
    with pytest.raises(BootstrapError, match="over"):
        read_initial_peers([f"@{big}"], timeout=1)
