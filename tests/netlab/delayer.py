"""Hold every packet of one netfilter queue for a fixed time, optionally dropping some: a link's latency.

This kernel has no netem, so the lab's router sends the packets of a host's link to an NFQUEUE and
this program, bound to that queue inside the router's namespace, gives each its verdict `--delay-ms`
after it arrived (in arrival order, so a link never reorders), dropping a `--loss` share at random.

    ip netns exec ROUTER python -m tests.netlab.delayer --queue 3 --delay-ms 25 [--loss 0.01]

It prints "bound" once the queue is its own, and runs until killed.

A lossless link takes the kernel's segmentation-offload packets whole (up to 64 KB of one TCP flow that the
sender handed its link at once) and only their metadata (the verdict needs no payload): one Python callback per
~45 wire packets instead of one each. Taking every 1.5 KB packet through Python, it spent 2.2 s of CPU on
60 MB at 25 ms and 100 Mbit/s, where it now spends 0.7-0.9 s; in a swarm in the lab that was a quarter of this
2-core machine's CPU taken from the swarm it measured. A lossy link keeps wire packets, so that its losses stay
packet by packet.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import select
import socket
import struct
import sys
import time

from netfilterqueue import COPY_META, COPY_PACKET, NetfilterQueue

MAX_QUEUED = 65536  # packets the kernel may hold for us; beyond that it drops (a full router buffer)
# nfnetlink_queue's configuration message (linux/netfilter/nfnetlink_queue.h), which the NetfilterQueue package
# does not expose: NFQNL_MSG_CONFIG of subsystem NFNL_SUBSYS_QUEUE, attributes NFQA_CFG_MASK and NFQA_CFG_FLAGS
# with the flag NFQA_CFG_F_GSO (queue offload packets whole).
NFQNL_CONFIG_TYPE = (3 << 8) | 2
NFQA_CFG_MASK, NFQA_CFG_FLAGS, NFQA_CFG_F_GSO = 4, 5, 1 << 2
NLM_F_REQUEST = 1


def take_offload_packets_whole(fd: int, queue: int) -> None:
    """Ask the kernel to queue segmentation-offload packets to this queue unsegmented (no acknowledgement asked:
    a kernel that refused would keep segmenting them, which is only slower; this one takes it)."""
    attrs = b"".join(struct.pack("=HH", 8, kind) + struct.pack(">I", NFQA_CFG_F_GSO)
                     for kind in (NFQA_CFG_MASK, NFQA_CFG_FLAGS))
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    os.write(fd, struct.pack("=IHHII", 16 + len(body), NFQNL_CONFIG_TYPE, NLM_F_REQUEST, 0, 0) + body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queue", type=int, required=True, help="NFQUEUE number to bind")
    parser.add_argument("--delay-ms", type=float, required=True, help="time each packet is held")
    parser.add_argument("--loss", type=float, default=0.0, help="share of packets dropped, 0..1")
    parser.add_argument("--seed", type=int, default=None, help="seed of the loss draws")
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or not 0.0 <= args.loss < 1.0:
        parser.error("--delay-ms must be >= 0 and --loss in [0, 1)")
    delay = args.delay_ms / 1000.0
    rng = random.Random(args.seed)
    held: collections.deque = collections.deque()  # (due, packet), due times non-decreasing

    def arrived(packet) -> None:
        if args.loss and rng.random() < args.loss:
            packet.drop()
        elif delay == 0:
            packet.accept()
        else:
            held.append((time.monotonic() + delay, packet))

    queue = NetfilterQueue()
    whole = args.loss == 0
    queue.bind(args.queue, arrived, max_len=MAX_QUEUED, mode=COPY_META if whole else COPY_PACKET)
    fd = queue.get_fd()
    if whole:
        take_offload_packets_whole(fd, args.queue)
    print("bound", flush=True)
    try:
        while True:
            now = time.monotonic()
            while held and held[0][0] <= now:
                held.popleft()[1].accept()
            wait = None if not held else max(0.0, held[0][0] - now)
            readable, _, _ = select.select([fd], [], [], wait)
            if readable:
                queue.run(block=False)  # takes what the kernel has queued; arrived() per packet
    except KeyboardInterrupt:
        pass
    finally:
        queue.unbind()
    return 0


if __name__ == "__main__":
    sys.exit(main())
