"""Signed, schema-checked DHT records of a run, over hivemind.DHT.

Map of the subsystem, from people-facing entry points down to pure logic::

    bootstrap.py  join_run(initial_peers, ...): start a node, ask an initial peer which run it serves
                  (RunInfoServicer over libp2p), fetch the run config its coordinator signed;
                  serve_run_info(...) makes this peer an entry point for others
    records.py    SwarmRecords: sync publish/lookup of the run config, server records, expert hosts, metrics,
                  checkpoint lists (who holds which stage checkpoint) and the run checkpoint
    node.py       start_dht(...): a hivemind.DHT process with our validators, bounded startup,
                  hivemind's failures turned into our errors; multiaddr parsing
    loop.py       BackgroundLoop: our asyncio thread for P2P handlers and calls
    identity.py   Identity / load_identity: one RSA key, the libp2p identity and the signer of our records
    keys.py       key layout ({run_id}_config, _metrics, _run_checkpoint, _experts, _stage{k}, _checkpoints{k}),
                  owner-marked subkeys, validators (RunRecordGuard: what a node accepts at a run's keys;
                  StoreBounds: the size and lifetime any value may have)
    verified.py   RememberedValidator: the node's validators, with the records they accepted remembered, so a
                  record read again unchanged is not verified again
    storage.py    BoundedStorage: what a node keeps for others, bounded in bytes, entries and lifetime,
                  shared among signers (every node's storage and cache, installed by start_dht)
    reachability.py  can other peers dial this one? found out on join and said in one line (direct,
                  relayed, unreachable); dial-back checks for others
    relays.py     what a relay promises: a slot asked of its libp2p relay service, and the limits it answers
    private.py    SwarmKey: a private swarm's secret (its run's network id, run_info's name, the sealed config)
    gate.py       RpcGate: in a private swarm, every RPC of a peer (DHT, stage calls, averaging) carries and
                  asks for a proof of the swarm key
    schemas.py    ServerRecord, ExpertHostRecord, RunConfigRecord, PeerMetricsRecord, CheckpointRecord,
                  RunCheckpointRecord: strict, tolerant of unknown fields; online(...): the records that
                  say ONLINE (online_steps: their steps)
    errors.py     SwarmDHTError and its subclasses

Every network wait is bounded by a named timeout (``DEFAULT_*_TIMEOUT`` in each module).
"""

from swarm.dht.bootstrap import (
    RunInfo,
    RunInfoServicer,
    join_run,
    read_initial_peers,
    request_run_info,
    serve_run_info,
    write_initial_peers,
)
from swarm.dht.errors import (
    BootstrapError,
    DHTProcessGone,
    DHTRequestTimeout,
    InvalidMultiaddr,
    RunConfigInvalid,
    RunConfigNotFound,
    SwarmDHTError,
)
from swarm.dht.identity import Identity, load_identity
from swarm.dht.keys import MAX_STAGES, make_validators
from swarm.dht.loop import BackgroundLoop
from swarm.dht.node import add_run_validators, parse_maddrs, peer_id, start_dht, visible_maddrs
from swarm.dht.private import SwarmKey, load_swarm_key
from swarm.dht.records import SwarmRecords
from swarm.dht.schemas import (
    CheckpointRecord,
    ExpertHostRecord,
    HeldCheckpoint,
    PeerMetricsRecord,
    RunCheckpointRecord,
    RunCheckpointStage,
    RunConfigRecord,
    ServedWork,
    ServerRecord,
    ServerState,
    online,
    online_steps,
)

__all__ = [
    "MAX_STAGES",
    "BackgroundLoop",
    "BootstrapError",
    "CheckpointRecord",
    "DHTProcessGone",
    "DHTRequestTimeout",
    "ExpertHostRecord",
    "HeldCheckpoint",
    "Identity",
    "InvalidMultiaddr",
    "PeerMetricsRecord",
    "ServedWork",
    "RunCheckpointRecord",
    "RunCheckpointStage",
    "RunConfigInvalid",
    "RunConfigNotFound",
    "RunConfigRecord",
    "RunInfo",
    "RunInfoServicer",
    "ServerRecord",
    "ServerState",
    "online",
    "online_steps",
    "SwarmDHTError",
    "SwarmKey",
    "SwarmRecords",
    "add_run_validators",
    "join_run",
    "load_identity",
    "load_swarm_key",
    "make_validators",
    "parse_maddrs",
    "peer_id",
    "request_run_info",
    "serve_run_info",
    "start_dht",
    "visible_maddrs",
    "read_initial_peers",
    "write_initial_peers",
]
