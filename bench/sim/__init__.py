"""A simulator of a large swarm that runs the project's own routing, placement and rebalancing code.

    swarm.py     the model: servers and trainers on a simulated clock, churn, the oracle
    network.py   regions and latencies, links, messages over fresh libp2p streams
    engine.py    the discrete-event clock
    run.py       a swarm with rebalancing and without, side by side, against the oracle
    measure.py   a real small swarm measured for the validation
    validate.py  the simulator given a real swarm's service times: does it reproduce its samples/s?
"""
