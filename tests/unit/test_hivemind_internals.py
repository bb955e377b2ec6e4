"""hivemind's private names that swarm/hivemind_internals.py relies on are still there, and still mean
what it assumes. A hivemind upgrade that changes one fails here, by name."""

import asyncio
import inspect
import multiprocessing as mp
import os
import re
import signal
import threading

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import TensorPartContainer
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.mpfuture import MPFuture, SharedBytes
from pydantic.v1 import BaseModel, StrictInt

from swarm import hivemind_internals
from swarm.hivemind_internals import AveragerInternals, RoundRefused, private_key_from, schema_count

pytestmark = pytest.mark.timeout(60)

def class_source(cls: type) -> str:
    """The source of `cls`'s own functions. (inspect.getsource of a class parses its module into an AST,
    which CPython 3.11 can break with "AST constructor recursion depth mismatch" when the garbage
    collector runs a finalizer mid-parse; a function's source is found without parsing.)"""
    functions = []
    for member in vars(cls).values():
        if isinstance(member, property):
            functions += [f for f in (member.fget, member.fset, member.fdel) if f is not None]
        elif isinstance(member, (classmethod, staticmethod)):
            functions.append(member.__func__)
        elif inspect.isfunction(member):
            functions.append(member)
    return "\n".join(inspect.getsource(f) for f in functions)


AVERAGER = class_source(DecentralizedAverager)


def assigns(cls: type, attribute: str) -> bool:
    """Whether `cls`'s source sets `self.<attribute>` (alone or in a tuple assignment)."""
    return re.search(rf"self\.{attribute}\b[^=\n]*=(?!=)", class_source(cls)) is not None


@pytest.mark.parametrize("attribute", ["_averaged_tensors", "_running_groups", "_outer_pipe", "_p2p", "_matchmaking"])
def test_the_averager_still_has_the_attributes_we_read(attribute):
    assert assigns(DecentralizedAverager, attribute)


def test_the_averaging_process_still_runs_any_method_sent_down_its_pipe():
    # send_to_child and the methods of ours it names (_set_round, _download_state) rely on this
    assert "method, args, kwargs = self._inner_pipe.recv()" in AVERAGER
    assert "getattr(self, method)(*args, **kwargs)" in AVERAGER


@pytest.mark.parametrize("hook", ["_declare_for_download_periodically", "_trigger_declare_load_state",
                                  "_aggregate_with_group", "_step"])
def test_the_hooks_we_override_are_still_coroutines_hivemind_calls(hook):
    assert inspect.iscoroutinefunction(getattr(DecentralizedAverager, hook))
    assert re.search(rf"(self\.{hook}\(|\"{hook}\")", AVERAGER), f"hivemind no longer calls {hook}"
    assert getattr(AveragerInternals, hook) is not getattr(DecentralizedAverager, hook)


def test_a_refused_round_reaches_its_caller_through_the_future_and_goes_no_further(monkeypatch):
    # hivemind's step sets any error on the round's future before raising it again out of its task
    assert re.search(r"if not step\.done\(\):\s+step\.set_exception\(e\)\s+raise", inspect.getsource(
        DecentralizedAverager._step))

    async def refusing(self, **kwargs):
        raise RoundRefused("lost a part")

    async def failing(self, **kwargs):
        raise ValueError("something else")

    class Bare(AveragerInternals):  # (no process behind it: nothing to stop when it is collected)
        def __del__(self):
            pass

    averager = object.__new__(Bare)
    monkeypatch.setattr(DecentralizedAverager, "_step", refusing)
    asyncio.run(averager._step(step=None, future_for_init=None))
    monkeypatch.setattr(DecentralizedAverager, "_step", failing)
    with pytest.raises(ValueError):
        asyncio.run(averager._step(step=None, future_for_init=None))


def test_aggregate_with_group_keeps_its_signature():
    parameters = inspect.signature(DecentralizedAverager._aggregate_with_group).parameters
    assert list(parameters)[:3] == ["self", "group_info", "min_vector_size"]


def test_matchmaking_keeps_the_group_key_and_size_we_set():
    assert assigns(Matchmaking, "group_key_manager") and assigns(Matchmaking, "target_group_size")
    for attribute in ("prefix", "group_bits", "target_group_size"):
        assert assigns(GroupKeyManager, attribute)
    # the key hivemind itself declares and reads state sources under
    assert 'f"{self._matchmaking.group_key_manager.prefix}.all_averagers"' in AVERAGER


def test_matchmaking_still_declares_and_finds_averagers_only_through_its_key_manager():
    # direct.py's DirectKeyManager replaces the manager (use_key_manager) and overrides these two methods
    from hivemind.averaging.matchmaking import PotentialLeaders

    leaders = class_source(PotentialLeaders)
    assert "key_manager.get_averagers(key_manager.current_key, only_active=True)" in leaders
    assert "await key_manager.declare_averager(" in leaders and "looking_for_group=False" in leaders
    assert "self.group_key_manager" in class_source(Matchmaking)
    assert not re.search(r"\bdht\.(get|store)\(", leaders + class_source(Matchmaking))  # (no other way in)
    assert list(inspect.signature(GroupKeyManager.declare_averager).parameters) == [
        "self", "group_key", "peer_id", "expiration_time", "looking_for_group"]
    assert list(inspect.signature(GroupKeyManager.get_averagers).parameters) == ["self", "group_key", "only_active"]


def test_a_round_runner_still_counts_the_part_of_the_vector_that_failed():
    assert assigns(AllReduceRunner, "tensor_part_container")
    container = TensorPartContainer([torch.zeros(8)], peer_fractions=(1.0,))
    assert container.failed_size == 0 and container.total_size == 8


def test_after_all_reduce_sees_hivemind_s_runner_bookkeeping(monkeypatch):
    from concurrent.futures import Future
    from types import SimpleNamespace

    seen = []

    class Probe(AveragerInternals):
        def after_all_reduce(self, failed_size, total_size):
            seen.append((failed_size, total_size))

    async def finished(self, group_info, min_vector_size, **kwargs):
        return "gathered"

    monkeypatch.setattr(DecentralizedAverager, "_aggregate_with_group", finished)
    probe = Probe.__new__(Probe)
    probe._parent_pid = None  # (what its __del__ looks at)
    runner = Future()
    runner.set_result(SimpleNamespace(tensor_part_container=TensorPartContainer([torch.zeros(8)], (1.0,))))
    probe._running_groups = {b"g": runner}
    assert asyncio.run(probe._aggregate_with_group(SimpleNamespace(group_id=b"g"), 0)) == "gathered"
    assert seen == [(0, 8)]


def test_a_round_that_only_forms_its_group_reads_the_gathered_data_as_hivemind_packs_it():
    import asyncio as aio
    from types import SimpleNamespace

    from hivemind.utils import MSGPackSerializer

    class GroupOnly(AveragerInternals):
        def runs_all_reduce(self):
            return False

    # hivemind packs each member's gather as [bandwidth, mode, msgpack(user data)] (what _group_only unpacks)
    assert "user_data_for_gather = self.serializer.dumps(gather)" in AVERAGER
    assert "self.serializer.dumps([self.bandwidth, self.mode.value, user_data_for_gather])" in AVERAGER
    probe = GroupOnly.__new__(GroupOnly)
    probe._parent_pid = None
    probe.serializer = MSGPackSerializer
    registered = aio.Future(loop=aio.new_event_loop())
    probe._running_groups = {b"g": registered}
    packed = [MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps({"step": s})]) for s in (3, 4)]
    group = SimpleNamespace(group_id=b"g", peer_ids=["a", "b"], gathered=packed)
    got = asyncio.run(probe._aggregate_with_group(group, 0))
    assert got == {"a": {"step": 3, "group_id": "67"}, "b": {"step": 4, "group_id": "67"}}
    assert registered.done()  # (so hivemind does not warn of a group that never ran)


def test_the_inherited_p2p_replica_and_its_socket_path_are_still_where_we_clear_them():
    assert assigns(DHT, "_p2p_replica")
    assert assigns(P2P, "_client_listen_maddr")
    assert "_client_listen_maddr" in inspect.getsource(P2P.__del__) or "_client_listen_maddr" in inspect.getsource(
        P2P._terminate)

    class Holder:
        pass

    dht, replica = Holder(), Holder()
    replica._client_listen_maddr = "/unix/p2pclient.sock"
    dht._p2p_replica = replica
    hivemind_internals.forget_inherited_p2p_socket(dht)
    assert replica._client_listen_maddr is None


def test_a_private_key_filled_in_signs_as_hivemind_s_own_key_does():
    loaded = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    key = private_key_from(loaded)
    signature = key.sign(b"record")
    assert RSAPublicKey.from_bytes(key.get_public_key().to_bytes()).verify(b"record", signature)
    assert RSASignatureValidator(key).local_public_key  # hivemind's validator accepts it


def test_schema_count_counts_merged_schemas():
    class One(BaseModel):
        a: StrictInt

    class Two(BaseModel):
        b: StrictInt

    validator = SchemaValidator(One, prefix="x")
    assert schema_count(validator) == 1
    assert validator.merge_with(SchemaValidator(Two, prefix="x"))
    assert schema_count(validator) == 2


def test_the_averager_still_builds_its_runner_by_module_name_and_the_runner_its_reducer():
    # AveragerInternals.run swaps hivemind.averaging.averager.AllReduceRunner for PolicyAllReduceRunner, in
    # the averaging process only: here, in the process that forks them, it is still hivemind's
    import hivemind.averaging.averager as averager_module

    assert averager_module.AllReduceRunner is AllReduceRunner
    assert "runner = AllReduceRunner(" in AVERAGER
    assert assigns(AllReduceRunner, "tensor_part_reducer")
    assert "tensor_part_reducer.accumulate_part(" in class_source(AllReduceRunner)
    # PolicyPartReducer records each sender's weight by index; the round maps indices to sender_peer_ids
    from hivemind.averaging.partition import TensorPartReducer

    assert assigns(AllReduceRunner, "sender_peer_ids")
    assert list(inspect.signature(TensorPartReducer.accumulate_part).parameters) == [
        "self", "sender_index", "part_index", "tensor_part", "weight"]


def test_the_reducer_still_sums_into_an_accumulator_and_divides_once():
    # PolicyPartReducer stands a recorder in for `accumulator`: hivemind must call add_(part, alpha=weight)
    # per contribution and take div_(...)'s result as the averaged part
    from hivemind.averaging.partition import TensorPartReducer

    source = class_source(TensorPartReducer)
    assert "self.accumulator.add_(tensor_part, alpha=weight)" in source
    assert "set_result(self.accumulator.div_(self.denominator))" in source
    assert assigns(TensorPartReducer, "finished") and assigns(TensorPartReducer, "part_shapes")


def test_an_rsa_public_key_still_keeps_its_cryptography_key_where_we_read_it():
    # public_key_der (keys.peer_id_of_public_key) reads RSAPublicKey._public_key
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.hivemind_internals import public_key_der

    key = RSAPrivateKey()
    der = public_key_der(key.get_public_key())
    assert isinstance(key.get_public_key()._public_key, rsa.RSAPublicKey)
    assert RSAPublicKey.from_bytes(key.get_public_key().to_bytes())._public_key.public_numbers() == \
        key._private_key.public_key().public_numbers()
    assert der.startswith(b"0\x82")  # a DER SEQUENCE


def _mpfuture_lock(name: str):
    return SharedBytes._lock if name == "allocator" else MPFuture._initialization_lock


def _hold_until_killed(lock_name: str, holding) -> None:
    _mpfuture_lock(lock_name).acquire()
    holding.set()
    signal.pause()  # until the parent's SIGKILL


@pytest.mark.parametrize("lock_name", ["allocator", "initialization"])
def test_a_child_killed_while_it_holds_an_mpfuture_lock_leaves_the_parent_able_to_make_futures(lock_name):
    assert hivemind_internals  # (imported: its fork hook is registered)
    context = mp.get_context("fork")
    holding = context.Event()
    child = context.Process(target=_hold_until_killed, args=(lock_name, holding), daemon=True)
    child.start()
    try:
        assert holding.wait(10), "the child never took the lock"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    lock = _mpfuture_lock(lock_name)
    assert lock.acquire(timeout=5), "the parent's lock is still held by a dead child"
    lock.release()
    future = MPFuture()  # takes both locks
    future.set_result(1)
    assert future.result(timeout=5) == 1


def _hold_the_update_lock(holding) -> None:
    MPFuture._update_lock.acquire()
    holding.set()
    signal.pause()  # until the parent's SIGKILL


def _answer_from_a_child(future: MPFuture) -> None:
    future.set_result("from the child")  # (sent to the parent under the update lock)


def test_a_child_killed_while_it_holds_the_update_lock_leaves_the_family_able_to_send_results():
    # (the lock we swap in is the one hivemind takes to send a result to another process)
    assert "with MPFuture._update_lock" in inspect.getsource(MPFuture._send_update)
    assert isinstance(MPFuture._update_lock, hivemind_internals.DeathReleasedLock)
    context = mp.get_context("fork")
    holding = context.Event()
    child = context.Process(target=_hold_the_update_lock, args=(holding,), daemon=True)
    child.start()
    lock = MPFuture._update_lock
    try:
        assert holding.wait(10), "the child never took the lock"
        assert not lock.acquire(False), "a child's hold does not exclude its parent"  # still one lock
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    assert lock.acquire(False), "the update lock is still held by a dead child"  # (released as it died)
    lock.release()
    future = MPFuture()
    sender = context.Process(target=_answer_from_a_child, args=(future,), daemon=True)
    sender.start()
    try:
        assert future.result(timeout=10) == "from the child"
    finally:
        sender.join(10)


def test_the_update_lock_orders_the_threads_of_one_process():
    lock = MPFuture._update_lock
    assert lock.acquire(False)
    try:
        taken = []
        other = threading.Thread(target=lambda: taken.append(lock.acquire(False)))
        other.start()
        other.join(5)
        assert taken == [False]
    finally:
        lock.release()
    assert lock.acquire(False)
    lock.release()


def test_a_dht_node_asks_of_its_storage_and_cache_only_what_bounded_storage_answers():
    """swarm/dht/storage.py puts BoundedStorage in place of DHTProtocol's `storage` and `cache`."""
    from hivemind.dht import node, protocol

    from swarm.dht.storage import BoundedStorage

    sources = inspect.getsource(protocol) + inspect.getsource(node)
    called = set(re.findall(r"\b(?:storage|cache)\.(\w+)\(", sources))
    assert called == {"store", "store_subkey", "get", "items"}
    assert all(callable(getattr(BoundedStorage, name, None)) for name in called)
    assert "self.storage, self.cache = " in inspect.getsource(protocol.DHTProtocol.create)


def test_p2pd_flags_added_in_a_process_reach_the_daemon_command_line_beside_hivemind_s(monkeypatch):
    monkeypatch.setattr(P2P, "_make_process_args", P2P.__dict__["_make_process_args"])  # restored after the test
    hivemind_internals.add_p2pd_flags({"relayService": True, "relay": False},
                                      with_trusted_relays={"relayDiscovery": False})
    args = P2P._make_process_args("/bin/p2pd", relay=True, autoRelay=True, trustedRelays="/ip4/1.2.3.4/tcp/1/p2p/Qm")
    assert args[0] == "/bin/p2pd"
    assert set(args[1:]) == {"-relayDiscovery=0", "-relayService=1", "-relay=1", "-autoRelay=1",  # hivemind's win
                             "-trustedRelays=/ip4/1.2.3.4/tcp/1/p2p/Qm"}
    # hivemind's throwaway daemon that checks an identity is free: auto-relay, no relays; p2pd would refuse
    # to start with relay discovery off as well
    args = P2P._make_process_args("/bin/p2pd", relay=True, autoRelay=True)
    assert set(args[1:]) == {"-relayService=1", "-relay=1", "-autoRelay=1"}
    flags = inspect.signature(P2P.create).parameters
    assert {"use_relay", "use_auto_relay", "trusted_relays", "force_reachability"} <= set(flags)


def test_the_all_reduce_still_sends_through_the_two_generators_we_count():
    # PolicyAllReduceRunner counts what it sends by wrapping these: parts to their reducers, averaged parts back
    runner = class_source(AllReduceRunner)
    assert inspect.isasyncgenfunction(AllReduceRunner._generate_input_for_peer)
    assert list(inspect.signature(AllReduceRunner._generate_input_for_peer).parameters) == ["self", "peer_index"]
    assert "self._generate_input_for_peer(" in runner
    assert inspect.isasyncgenfunction(AllReduceRunner.rpc_aggregate_part)
    assert list(inspect.signature(AllReduceRunner.rpc_aggregate_part).parameters) == ["self", "stream", "context"]
    assert ".rpc_aggregate_part(" in AVERAGER  # the averager hands each incoming stream to its round's runner


def test_the_all_reduce_still_registers_results_as_the_canonical_runner_takes_them():
    # PolicyAllReduceRunner(canonical=...) wraps the container's register_processed_part and register_failed_reducer
    # (a failed reducer's parts go through the first), reads the local part at _input_parts_by_peer[peer][part][0],
    # and answers AVERAGED_PART messages whose tensor_part it replaces; the reducer registers its own part's
    # difference itself, and each reply is serialized with the part's own compression
    from hivemind.averaging.partition import TensorPartContainer

    container = class_source(TensorPartContainer)
    assert list(inspect.signature(TensorPartContainer.register_processed_part).parameters) == [
        "self", "peer_index", "part_index", "part"]
    assert "self.register_processed_part(peer_index, part_index, part_result_or_delta)" in container
    assert "self._input_parts_by_peer[assigned_peer_index].append((part, part_info))" in container
    runner = class_source(AllReduceRunner)
    assert "register_processed_part(peer_index, part_index, averaged_part - tensor_part)" in runner
    assert "self.tensor_part_container.register_processed_part(peer_index, part_index, delta)" in runner
    assert "register_failed_reducer(" in runner
    assert "serialize_torch_tensor(averaged_part - tensor_part, part_compression)" in runner
    assert "code=averaging_pb2.AVERAGED_PART, tensor_part=serialized_delta" in runner
    assert assigns(AllReduceRunner, "ordered_peer_ids") and assigns(AllReduceRunner, "peer_id")


def test_the_daemon_client_still_connects_and_opens_raw_streams_as_we_call_it():
    from hivemind.p2p.p2p_daemon_bindings.p2pclient import Client

    assert assigns(P2P, "_client")
    assert list(inspect.signature(Client.connect).parameters) == ["self", "peer_id", "maddrs"]
    assert list(inspect.signature(Client.stream_open).parameters) == ["self", "peer_id", "protocols"]
    assert "return await self.control.stream_open(" in inspect.getsource(Client.stream_open)


def test_protobuf_streams_still_go_through_the_two_methods_streams_py_replaces():
    # streams.callers_close_first replaces them: every protobuf stream handler (stream input or output) is added
    # through the first, every stream call made through the second, both on P2P's binary streams
    from swarm.hivemind_internals import streams

    added = inspect.signature(streams.HIVEMIND_ADD_STREAM_HANDLER).parameters
    assert list(added) == ["self", "name", "handler", "input_protobuf_type", "max_prefetch", "balanced"]
    assert "_add_protobuf_stream_handler" in inspect.getsource(P2P.add_protobuf_handler)
    called = inspect.signature(streams.HIVEMIND_CALL_STREAM_HANDLER).parameters
    assert list(called) == ["self", "peer_id", "name", "requests", "output_protobuf_type"]
    assert "self._iterate_protobuf_stream_handler(" in inspect.getsource(P2P.iterate_protobuf_handler)
    assert "add_binary_stream_handler(" in inspect.getsource(streams.HIVEMIND_ADD_STREAM_HANDLER)
    assert "call_binary_stream_handler(" in inspect.getsource(streams.HIVEMIND_CALL_STREAM_HANDLER)


def test_a_plain_hivemind_handler_takes_any_error_frame_from_its_caller_as_the_end_of_its_stream():
    # so our callers' end-of-stream marker, an RPCError with a message, ends a plain handler's input as its own does
    from hivemind.proto.p2pd_pb2 import RPCError

    from swarm.hivemind_internals import streams

    assert isinstance(P2P.END_OF_STREAM, RPCError) and not P2P.END_OF_STREAM.message
    assert "request, _ = await receive_task" in inspect.getsource(streams.HIVEMIND_ADD_STREAM_HANDLER)


def _parts(*group_ids: bytes):
    async def stream():
        for group_id in group_ids:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=group_id)
    return stream()


class _QuickRefusal(AveragerInternals):
    def unknown_group_wait(self):
        return 0.1


def test_a_part_for_a_group_not_running_here_is_refused_once_the_wait_is_over():
    # hivemind's handler waits for the next group to register: while this member still looks for a group
    # (the leader's word that it formed never came), as long as its matchmaking lasts
    assert "await self._pending_groups_registered.wait()" in class_source(DecentralizedAverager)
    probe = _QuickRefusal.__new__(_QuickRefusal)
    probe._parent_pid = None
    probe._running_groups = {}

    async def answers():
        return [m async for m in probe.rpc_aggregate_part(_parts(b"unknown"), None)]

    replies = asyncio.run(asyncio.wait_for(answers(), 5))
    assert [r.code for r in replies] == [averaging_pb2.BAD_GROUP_ID]


def test_a_part_for_a_group_registered_meanwhile_goes_to_its_runner_first_part_included():
    from types import SimpleNamespace

    class RegisteredOnceLookedFor(dict):
        """The running groups, where the leader's word that the group formed comes just after its first part:
        the first look finds nothing, and registers it."""

        def __contains__(self, group_id):
            found = super().__contains__(group_id)
            if not found:
                self[group_id] = registered
            return found

    async def runner_handler(stream, context):
        async for message in stream:
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, group_id=message.group_id)

    probe = _QuickRefusal.__new__(_QuickRefusal)
    probe._parent_pid = None
    probe._running_groups = RegisteredOnceLookedFor()

    async def answers():
        nonlocal registered
        probe._pending_groups_registered = asyncio.Event()
        registered = asyncio.get_running_loop().create_future()
        registered.set_result(SimpleNamespace(rpc_aggregate_part=runner_handler))
        return [m async for m in probe.rpc_aggregate_part(_parts(b"g", b"g"), None)]

    registered = None
    replies = asyncio.run(asyncio.wait_for(answers(), 5))
    assert [(r.code, r.group_id) for r in replies] == [(averaging_pb2.AVERAGED_PART, b"g")] * 2


def test_a_peer_that_failed_as_a_reducer_is_banned_as_a_sender(monkeypatch):
    # hivemind: run() talks to each reducer in _communicate_with_peer, and _ban_sender stops waiting for a
    # sender's parts (what PolicyAllReduceRunner calls when the exchange with a peer failed)
    assert "self._communicate_with_peer(" in class_source(AllReduceRunner)
    assert list(inspect.signature(AllReduceRunner._ban_sender).parameters) == ["self", "peer_id"]
    assert "self.tensor_part_reducer.on_sender_failed(" in inspect.getsource(AllReduceRunner._ban_sender)
    from types import SimpleNamespace

    from swarm.hivemind_internals import PolicyAllReduceRunner

    async def failing(self, peer_id):
        raise ConnectionError(f"{peer_id} is gone")

    monkeypatch.setattr(AllReduceRunner, "_communicate_with_peer", failing)
    failed = []
    runner = PolicyAllReduceRunner.__new__(PolicyAllReduceRunner)
    runner.sender_peer_ids, runner.banned_senders = ["a", "b"], set()
    runner.tensor_part_reducer = SimpleNamespace(on_sender_failed=failed.append)

    async def talk():
        runner.banlock = asyncio.Lock()
        with pytest.raises(ConnectionError):
            await runner._communicate_with_peer("b")

    asyncio.run(talk())
    assert failed == [1] and runner.banned_senders == {"b"}


def _replies_to(*call_ids) -> bytes:
    """What p2pd sends on the persistent connection: a varint-prefixed unary reply to each call."""
    from hivemind.proto import p2pd_pb2

    out = b""
    for call_id in call_ids:
        message = p2pd_pb2.PersistentConnectionResponse(
            callId=call_id.bytes, callUnaryResponse=p2pd_pb2.CallUnaryResponse(response=b"ok")).SerializeToString()
        n, prefix = len(message), b""
        while True:
            prefix += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                break
        out += prefix + message
    return out


@pytest.mark.parametrize("mended", [False, True])
def test_a_reply_to_a_call_cancelled_in_the_same_instant_stops_the_reader_unless_mended(monkeypatch, mended):
    """hivemind's reader of unary replies sets each on its call's future: on a future that a cancel reached
    first it raises InvalidStateError and reads nothing more, so every later reply is lost."""
    from uuid import uuid4

    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    monkeypatch.setattr(ControlClient, "_read_from_persistent_conn", ControlClient._read_from_persistent_conn)
    if mended:
        hivemind_internals.keep_reading_after_a_late_reply()
        hivemind_internals.keep_reading_after_a_late_reply()  # (once is enough: not wrapped twice)
    cancelled, live = uuid4(), uuid4()

    async def read() -> tuple[BaseException | None, bool]:
        client = ControlClient.__new__(ControlClient)
        loop = asyncio.get_running_loop()
        client._pending_calls = {cancelled: loop.create_future(), live: loop.create_future()}
        client._handler_tasks, client._read_task, client._write_task = {}, None, None
        client._pending_calls[cancelled].cancel()  # its caller gave up just as the reply came
        reader = asyncio.StreamReader()
        reader.feed_data(_replies_to(cancelled, live))
        reader.feed_eof()
        try:
            await asyncio.wait_for(client._read_from_persistent_conn(reader), 5)
        except asyncio.InvalidStateError as e:
            return e, client._pending_calls[live].done()
        return None, client._pending_calls[live].result() == b"ok"

    error, answered = asyncio.run(read())
    assert (error is None and answered) if mended else (error is not None and not answered)
