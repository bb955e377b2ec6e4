"""Bytes sent by kind: counting frames as they are taken, the DHT's unary RPCs, the exported family, and
the per-sample formula the README gives."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from prometheus_client import CollectorRegistry

import swarm.traffic as traffic
from swarm.hivemind_internals import P2P_RPC_METHODS
from swarm.traffic import KINDS, Traffic, TrafficCollector, count_unary_rpcs, counted, wire_bytes_per_sample

pytestmark = pytest.mark.timeout(30)


def frame(nbytes: int) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=b"x" * nbytes)


def test_frames_are_counted_as_they_are_taken_not_before():
    sent = Traffic()
    frames = counted("forward", [frame(100), frame(200)], sent)
    assert sent.sent()["forward"] == 0
    next(frames)
    assert sent.sent()["forward"] == frame(100).ByteSize()
    list(frames)
    assert sent.sent() == {**dict.fromkeys(KINDS, 0), "forward": frame(100).ByteSize() + frame(200).ByteSize()}


def test_unary_requests_sent_and_replies_given_are_counted(monkeypatch):
    for method in ("call_unary", "add_unary"):  # put hivemind's back after the test
        monkeypatch.setattr(P2P, P2P_RPC_METHODS[method], getattr(P2P, P2P_RPC_METHODS[method]))
    handlers = {}

    async def call(self, peer_id, name, input, output_type):
        return await handlers[name](input, None)

    async def add(self, name, handler, input_type, balanced=False):
        handlers[name] = handler

    monkeypatch.setattr(P2P, P2P_RPC_METHODS["call_unary"], call)
    monkeypatch.setattr(P2P, P2P_RPC_METHODS["add_unary"], add)
    counter = traffic.shared_counter()
    count_unary_rpcs(counter)
    p2p = SimpleNamespace()  # the methods only pass it on

    async def echo_twice(request, context):
        return frame(2 * len(request.metadata))

    async def run():
        await getattr(P2P, P2P_RPC_METHODS["add_unary"])(p2p, "echo", echo_twice, runtime_pb2.ExpertRequest)
        return await getattr(P2P, P2P_RPC_METHODS["call_unary"])(p2p, None, "echo", frame(10), None)

    reply = asyncio.run(run())
    assert counter.value == frame(10).ByteSize() + reply.ByteSize()


class FakeDHT:
    def __init__(self, value: int):
        self.bytes_sent = traffic.shared_counter()
        self.bytes_sent.value = value


def test_the_family_adds_the_dht_process_bytes():
    sent = Traffic()
    sent.add("averaging", 7)
    sent.add("dht", 1)
    registry = CollectorRegistry()
    registry.register(TrafficCollector(FakeDHT(41), sent))
    assert registry.get_sample_value("swarm_bytes_sent_total", {"kind": "dht"}) == 42
    assert registry.get_sample_value("swarm_bytes_sent_total", {"kind": "averaging"}) == 7
    assert registry.get_sample_value("swarm_bytes_sent_total", {"kind": "forward"}) == 0


def test_the_formula_for_three_stages():
    a, k = 64 * 128 * 2, 64 * 4  # float16 on the wire
    assert wire_bytes_per_sample(64, 128, 3, 2) == {
        "trainer": 3 * k + 5 * a,  # forward: K to stage 0, A to stage 1; backward: K+A, A+A, A+K
        "stage 0": a, "stage 1": 2 * a, "stage 2": a,
    }
