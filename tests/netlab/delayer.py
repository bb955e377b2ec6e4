"""Hold every packet of one netfilter queue for a fixed time, optionally dropping some: a link's latency.

This kernel has no netem, so the lab's router sends the packets of a host's link to an NFQUEUE and
this program, bound to that queue inside the router's namespace, gives each its verdict `--delay-ms`
after it arrived (in arrival order, so a link never reorders), dropping a `--loss` share at random.

    ip netns exec ROUTER python -m tests.netlab.delayer --queue 3 --delay-ms 25 [--loss 0.01]

It prints "bound" once the queue is its own, and runs until killed.
"""

from __future__ import annotations

import argparse
import collections
import random
import select
import sys
import time

from netfilterqueue import NetfilterQueue

MAX_QUEUED = 65536  # packets the kernel may hold for us; beyond that it drops (a full router buffer)


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
    queue.bind(args.queue, arrived, max_len=MAX_QUEUED)
    print("bound", flush=True)
    fd = queue.get_fd()
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
