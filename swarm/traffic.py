"""Bytes this peer sends, by what they carry, so an operator can tell what uplink a stage needs.

Exported as ``swarm_bytes_sent_total{kind}``; divided by the peer's samples (``swarm_trainer_samples_total``,
``swarm_server_samples_total``) it is bytes per sample. Kinds:

- ``forward``: forward requests (a trainer: the stage's inputs, tokens for stage 0) and replies (a
  server: the stage's activations), as framed on the wire (swarm.protocol.framing).
- ``backward``: backward requests (the stage's inputs again, and the gradient of its outputs, or the
  targets for the last stage) and replies (the gradient of the stage's inputs).
- ``averaging``: what this server sent in averaging rounds: the all-reduce's messages (counted in the
  averaging process, swarm.hivemind_internals.PolicyAllReduceRunner) or the ZeRO-sharded collective's.
- ``dht``: DHT requests and replies (hivemind's unary RPCs in the DHT process), protobuf bytes.

Counted as messages are handed to the libp2p daemon: libp2p's own framing, encryption and
retransmissions are not included (a few percent on large messages).
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily

from swarm.hivemind_internals import wrap_p2p_rpc_methods

KINDS = ("forward", "backward", "averaging", "dht")


class Traffic:
    """Bytes sent by kind in this process; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._sent[kind] += int(nbytes)

    def sent(self) -> dict[str, int]:
        with self._lock:
            return dict(self._sent)


TRAFFIC = Traffic()


def counted(kind: str, frames: Iterable[Any], traffic: Traffic = TRAFFIC) -> Iterator[Any]:
    """`frames` (protobuf messages), each counted as `kind` when it is taken to be sent."""
    for frame in frames:
        traffic.add(kind, frame.ByteSize())
        yield frame


def shared_counter() -> Any:
    """A byte counter a forked child (the DHT process) adds to and its parent reads."""
    return multiprocessing.RawValue("Q", 0)


def count_unary_rpcs(counter: Any) -> None:
    """From now on, in this process, add to `counter` the bytes of every unary request sent and every
    unary reply given (in the DHT process: the DHT's RPCs). Installed after the swarm-key gate, if any,
    so what is counted is the message without its proof."""
    lock = threading.Lock()

    def add(nbytes: int) -> None:
        with lock:
            counter.value += nbytes

    async def call_unary(self, peer_id, handle_name, input, output_protobuf_type):
        add(input.ByteSize())
        return await hivemind["call_unary"](self, peer_id, handle_name, input, output_protobuf_type)

    async def add_unary(self, handle_name, handler, input_protobuf_type, balanced=False):
        async def answered(request, context):
            reply = await handler(request, context)
            add(reply.ByteSize())
            return reply

        await hivemind["add_unary"](self, handle_name, answered, input_protobuf_type, balanced)

    hivemind = wrap_p2p_rpc_methods({"call_unary": call_unary, "add_unary": add_unary})


def wire_bytes_per_sample(seq_len: int, d_model: int, num_stages: int, float_bytes: int,
                          token_bytes: int = 4) -> dict[str, int]:
    """The tensor bytes one sample puts on the wire (metadata and framing not included), by sender:
    ``trainer``, and ``stage S`` for a server of stage S. With A = seq_len x d_model x float_bytes (one
    sample's activations) and K = seq_len x token_bytes (its tokens, or its targets):

    - the trainer sends forward requests to stages 0..S-2 (K to stage 0, A to the others: K + (S-2)A)
      and a backward request to every stage: its inputs again, and the gradient of its outputs (A), or
      the targets (K) to the last stage (2K + (2S-2)A); in all 3K + (3S-4)A;
    - a server sends its outputs in forward replies (stages 0..S-2) and the gradient of its inputs in
      backward replies (stages 1..S-1): A for the first and the last stage, 2A for one in between.
    """
    a, k, s = seq_len * d_model * float_bytes, seq_len * token_bytes, num_stages
    if s == 1:
        return {"trainer": 2 * k, "stage 0": 0}  # tokens forward-and-backward in one call, targets
    counts = {"trainer": 3 * k + (3 * s - 4) * a}
    for stage in range(s):
        counts[f"stage {stage}"] = (a if stage < s - 1 else 0) + (a if stage > 0 else 0)
    return counts


class TrafficCollector:
    """``swarm_bytes_sent_total{kind}`` at scrape time: this process's counts and the DHT process's."""

    def __init__(self, dht: Any = None, traffic: Traffic = TRAFFIC):
        self.dht_counter = getattr(dht, "bytes_sent", None)  # swarm.dht.node's DHT process counts there
        self.traffic = traffic

    def describe(self) -> list:
        return []

    def collect(self):
        family = CounterMetricFamily("swarm_bytes_sent", "Bytes this peer sent, by what they carry (forward: "
                                     "inputs and activations; backward: inputs again and gradients; averaging: "
                                     "all-reduce parts; dht: DHT RPCs)", labels=["kind"])
        sent = self.traffic.sent()
        if self.dht_counter is not None:
            sent["dht"] += self.dht_counter.value
        for kind in KINDS:
            family.add_metric([kind], sent[kind])
        yield family
