"""A real expert server refuses bad requests with a clear error reply, keeps serving, and takes in nothing.

One ExpertServer (experts 0 and 2 of MoE block 1; block 0 is dense) on its own peer, and a client
peer calling it with StageClient under the run's experts namespace, as a stage server does. After
every refused request the server still answers a good forward with the reference experts' outputs,
and no sample, token or gradient was accumulated towards its experts' next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter

from swarm.config import MoEConfig
from swarm.model import make_expert
from swarm.protocol import (
    BACKWARD,
    BAD_REQUEST,
    FORWARD,
    WRONG_STAGE,
    RemoteStageError,
    StageClient,
    StageReply,
    StageRequest,
    StageService,
    StageUnavailable,
    encode_tensor,
    experts_namespace,
    receive_reply,
    stage_wire_limits,
)
from swarm.protocol.framing import to_frames
from swarm.serving import ExpertOptions, ExpertServer
from tests.integration.inproc import BACKEND_CALL_TIMEOUT, Peer, running_peers, tiny_config

pytestmark = pytest.mark.timeout(120)

CALL_TIMEOUT = 20.0  # one RPC, generous for 2 shared CPU cores
HOSTED = [0, 2]
MOE_BLOCK, DENSE_BLOCK = 1, 0


def moe_config(run_id: str):
    # batch_size far above what any test sends: a good backward accumulates but never steps
    config = tiny_config(run_id, 2, batch_size=1000, micro_batch_size=4)
    config.model.moe = MoEConfig(every=2, num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_weight=0.5,
                                 expert_servers=True)
    return config.validate()


CONFIG = moe_config("expertinput")
D, MICRO, SEQ, TOP_K = CONFIG.model.d_model, CONFIG.optimizer.micro_batch_size, CONFIG.model.seq_len, 2
MAX_ROWS = TOP_K * MICRO * SEQ  # every slot of every token of a micro-batch
LIMITS = stage_wire_limits(CONFIG.model, MICRO * TOP_K)  # what the expert server takes in
assert CONFIG.model.moe_layers() == [MOE_BLOCK] and LIMITS.max_tensor_elements == MAX_ROWS * D


@dataclass
class Swarm:
    client: Peer
    server: ExpertServer
    stub: StageClient

    def call(self, coro) -> StageReply:
        return self.client.loop.run(coro, CALL_TIMEOUT + 5)

    def on_worker(self, fn):
        """`fn()` on the expert host's worker thread, between tasks."""
        return self.server.host.submit(fn).result(BACKEND_CALL_TIMEOUT)


@pytest.fixture(scope="module")
def running_swarm():
    with running_peers(CONFIG.run_id, 2) as (client, server_peer):
        server = ExpertServer(CONFIG, server_peer.dht, server_peer.records, server_peer.loop,
                              ExpertOptions(experts=HOSTED))
        try:
            server.start()
            stub = StageClient(client.p2p(), PeerID.from_base58(server.peer_id), experts_namespace(CONFIG.run_id),
                               timeout=CALL_TIMEOUT)
            yield Swarm(client, server, stub)
        finally:
            server.shutdown()


def reset(host) -> None:
    for optimizer in host.optimizers.values():
        optimizer.zero_grad()
    host.samples = 0
    for key in host.tokens:
        host.tokens[key] = 0


@pytest.fixture
def swarm(running_swarm):
    """The shared server, with whatever a test accumulated (the control) dropped after it."""
    yield running_swarm
    running_swarm.on_worker(lambda: reset(running_swarm.server.host))


def accumulated(swarm: Swarm) -> tuple[int, int, int, int]:
    """(samples the host took in, samples its optimizers hold, parameters with a gradient, tokens counted)."""
    host = swarm.server.host

    def read():
        return (host.samples, sum(opt.samples for opt in host.optimizers.values()),
                sum(p.grad is not None for m in host.modules.values() for p in m.parameters()),
                sum(host.tokens.values()))

    return swarm.on_worker(read)


def once_more(swarm: Swarm, call: Callable):
    """`swarm.call(call())`, sent once more if the transport failed (a cut reply stream on loaded cores);
    a refused or forward request changes nothing, so sending it twice is harmless."""
    try:
        return swarm.call(call())
    except StageUnavailable:
        return swarm.call(call())


def rows(n: int, d: int = D, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def with_value(tensor: torch.Tensor, value: float) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[tensor.numel() // 2] = value
    return tensor


def forward(experts, x, stage: int = MOE_BLOCK) -> StageRequest:
    return StageRequest(FORWARD, stage, "f", x, experts=experts)


def backward(experts, x, grad, samples: int | None = 2, stage: int = MOE_BLOCK) -> StageRequest:
    return StageRequest(BACKWARD, stage, "b", x, grad_outputs=grad, experts=experts, samples=samples)


def check_good_forward(swarm: Swarm) -> None:
    """A forward of both hosted experts answers what the reference experts compute."""
    x = rows(5, seed=1)
    reply = once_more(swarm, lambda: swarm.stub.call(forward([(2, 2), (0, 3)], x)))
    [out] = reply.tensors
    expected = torch.cat([make_expert(CONFIG.model, MOE_BLOCK, 2)(x[:2]),
                          make_expert(CONFIG.model, MOE_BLOCK, 0)(x[2:])])
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-5)
    assert reply.server_step == 0


@dataclass
class Raw:
    """A request as hand-made frames (metadata a StageClient would never build) to the `endpoint` RPC."""

    endpoint: str
    meta: dict
    tensors: list[torch.Tensor]


async def send_raw(stub: StageClient, raw: Raw) -> StageReply:
    frames = list(to_frames(raw.meta, [encode_tensor(t, "float32") for t in raw.tensors], runtime_pb2.ExpertRequest))
    service = StageService.get_stub(stub.p2p, stub.peer_id, namespace=stub.namespace)
    rpc = service.rpc_forward if raw.endpoint == FORWARD else service.rpc_backward
    responses = await rpc(iter_as_aiter(frames))
    try:
        return await asyncio.wait_for(receive_reply(responses), CALL_TIMEOUT)
    finally:
        await responses.aclose()


def raw_meta(kind: str, **fields) -> dict:
    return dict(kind=kind, stage=MOE_BLOCK, request_id=f"raw-{kind}", wire_dtype="float32", **fields)


@dataclass
class Case:
    build: Callable[[], StageRequest | Raw]
    code: str
    message: str  # a fragment the error message must contain


G = rows(4, seed=2)
CASES = {
    # shapes and dtypes
    "wrong-d_model-forward": Case(lambda: forward([(0, 4)], rows(4, D + 1)), BAD_REQUEST, f"[rows, {D}]"),
    "wrong-d_model-backward": Case(lambda: backward([(0, 4)], rows(4, D - 1), rows(4, D - 1)), BAD_REQUEST,
                                   f"[rows, {D}]"),
    "integer-inputs": Case(lambda: forward([(0, 4)], torch.ones(4, D, dtype=torch.long)), BAD_REQUEST,
                           "must be floats"),
    "grad-shape-mismatch": Case(lambda: backward([(0, 4)], rows(4), rows(4, D + 1)), BAD_REQUEST,
                                "the output gradient must be floats of the inputs' shape"),
    # values
    "nan-inputs-forward": Case(lambda: forward([(0, 4)], with_value(rows(4), float("nan"))), BAD_REQUEST,
                               "non-finite"),
    "inf-inputs-backward": Case(lambda: backward([(0, 4)], with_value(rows(4), float("inf")), G), BAD_REQUEST,
                                "non-finite"),
    "nan-grad": Case(lambda: backward([(0, 4)], rows(4), with_value(G, float("nan"))), BAD_REQUEST,
                     "the output gradient has non-finite values"),
    # which experts, which block
    "expert-not-hosted-forward": Case(lambda: forward([(0, 2), (1, 2)], rows(4)), BAD_REQUEST,
                                      "experts [1] are not hosted here"),
    "expert-not-hosted-backward": Case(lambda: backward([(3, 4)], rows(4), G), BAD_REQUEST,
                                       "experts [3] are not hosted here"),
    "expert-beyond-the-run": Case(lambda: forward([(9, 4)], rows(4)), BAD_REQUEST, "experts [9] are not hosted"),
    "no-experts-named": Case(lambda: StageRequest(FORWARD, MOE_BLOCK, "n", rows(4)), BAD_REQUEST,
                             "must name its experts"),
    "dense-block": Case(lambda: forward([(0, 4)], rows(4), stage=DENSE_BLOCK), WRONG_STAGE,
                        f"block {DENSE_BLOCK} is not a mixture of experts"),
    "block-beyond-the-run": Case(lambda: backward([(0, 4)], rows(4), G, stage=7), WRONG_STAGE,
                                 "block 7 is not a mixture of experts"),
    # samples
    "backward-without-samples": Case(lambda: backward([(0, 4)], rows(4), G, samples=None), BAD_REQUEST,
                                     "how many samples"),
    "samples-over-micro_batch_size": Case(lambda: backward([(0, 4)], rows(4), G, samples=MICRO + 1), BAD_REQUEST,
                                          f"at most {MICRO} samples, got {MICRO + 1}"),
    # rows
    "rows-over-the-limit": Case(lambda: forward([(0, MAX_ROWS + 1)], rows(MAX_ROWS + 1)), BAD_REQUEST,
                                f"over the limit of {LIMITS.max_tensor_elements}"),
    "huge-row-count": Case(lambda: backward([(0, 10_000), (2, 10_000)], rows(20_000), rows(20_000)), BAD_REQUEST,
                           "over the limit"),
    # metadata a StageClient would not send
    "rows-not-adding-up": Case(lambda: Raw(FORWARD, raw_meta(FORWARD, experts=[[0, 5]]), [rows(4)]), BAD_REQUEST,
                               "experts account for 5 rows"),
    "expert-named-twice": Case(lambda: Raw(BACKWARD, raw_meta(BACKWARD, experts=[[0, 2], [0, 2]], samples=2),
                                           [rows(4), G]), BAD_REQUEST, "names an expert twice"),
    "samples-zero": Case(lambda: Raw(BACKWARD, raw_meta(BACKWARD, experts=[[0, 4]], samples=0), [rows(4), G]),
                         BAD_REQUEST, "samples must be a positive integer"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_requests_are_refused_and_leave_no_trace(swarm, case):
    before = swarm.on_worker(lambda: {k: {n: t.clone() for n, t in m.state_dict().items()}
                                      for k, m in swarm.server.host.modules.items()})
    request = case.build()
    with pytest.raises(RemoteStageError) as error:
        swarm.call(send_raw(swarm.stub, request) if isinstance(request, Raw) else swarm.stub.call(request))
    assert error.value.code == case.code
    assert case.message in error.value.message

    check_good_forward(swarm)
    assert accumulated(swarm) == (0, 0, 0, 0), "a refused request added samples, gradients or tokens"
    after = swarm.on_worker(lambda: {k: dict(m.state_dict()) for k, m in swarm.server.host.modules.items()})
    assert all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])
    assert swarm.server.host.step == 0


def test_a_good_backward_is_counted(swarm):
    """The control for the checks above: an accepted backward does show up in `accumulated`."""
    x = rows(6, seed=3)
    reply = once_more(swarm, lambda: swarm.stub.call(backward([(0, 4), (2, 2)], x, rows(6, seed=4), samples=3)))
    assert reply.tensors[0].shape == (6, D) and torch.isfinite(reply.tensors[0]).all()
    params = sum(1 for _ in make_expert(CONFIG.model, MOE_BLOCK, 0).parameters())
    # the host took 3 samples; each of its 2 experts counts them; 2 experts' parameters hold a gradient; 6 tokens
    assert accumulated(swarm) == (3, 3 * len(HOSTED), params * len(HOSTED), 6)
