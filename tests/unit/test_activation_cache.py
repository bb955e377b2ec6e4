"""The activation cache: a backward from a kept graph equals a recomputed one; eviction and misses are safe."""

import copy
import gc

import pytest
import torch

from swarm.activations import ActivationCache, SavedBytes
from swarm.backend import StageBackend, resolve_compute_dtype
from swarm.config import ConfigError, RunConfig
from swarm.model import build_stage
from swarm.optim import StageOptimizer

pytestmark = pytest.mark.timeout(60)

ME, OTHER = "peer-a", "peer-b"


def config(n_layer: int = 2, **stages) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"n_layer": n_layer, "n_head": 2, "d_model": 16, "seq_len": 8},
        "stages": {"num_stages": 2, **stages},
        # (no forwards ahead: they run on predicted parameters and are never kept; no batch waiting for backwards
        # on their way: these tests are of the cache, and of backwards a step late)
        "optimizer": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 0, "lookahead": False,
                      "drain_seconds": 0},
    })


def backend(stage: int = 0, cache_bytes: int | None = 1 << 30, run: RunConfig | None = None, **kw) -> StageBackend:
    run = run or config()
    module = build_stage(run, stage)
    cache = None if cache_bytes is None else ActivationCache(cache_bytes, **kw)
    return StageBackend(module, StageOptimizer(module, run.optimizer), cache=cache,
                        compute_dtype=run.stages.compute_dtype)


def tokens(seed: int, n: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (n, 8), generator=torch.Generator().manual_seed(seed))


def hidden(seed: int, n: int = 2) -> torch.Tensor:
    return torch.randn(n, 8, 16, generator=torch.Generator().manual_seed(seed))


def grads(b: StageBackend) -> list[torch.Tensor]:
    return [p.grad.clone() for p in b.optimizer.params]


@pytest.mark.parametrize("stage", [0, 1])
def test_a_backward_from_the_kept_graph_equals_a_recomputed_one_exactly(stage):
    # stage 1 of 2 is the last: it keeps nothing (its backward runs its own forward), so test
    # a middle stage by making the run 3 stages deep
    run = config(n_layer=3, num_stages=3) if stage == 1 else config()
    cached, plain = backend(stage, run=run), backend(stage, cache_bytes=None, run=run)
    x = tokens(1) if stage == 0 else hidden(1)
    out, step = cached.forward_at(x, keep=(ME, "mb-1"))
    expected, _ = plain.forward_at(x)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    hit = cached.backward(x, grad, forward_step=step, key=(ME, "mb-1"))
    miss = plain.backward(x, grad, forward_step=step)
    assert hit.cached and not miss.cached
    assert (cached.cache.hits, cached.cache.misses, len(cached.cache), cached.cache.bytes_held) == (1, 0, 0, 0)
    for a, b in zip(grads(cached), grads(plain)):
        assert torch.equal(a, b)
    if stage == 0:
        assert hit.grad_input is None
    else:
        assert torch.equal(hit.grad_input, miss.grad_input)


def test_the_oldest_graph_is_evicted_for_room_and_its_backward_still_succeeds():
    probe = backend()
    probe.forward_at(tokens(1), keep=(ME, "probe"))
    one = probe.cache.bytes_held
    assert one > 0
    cached, plain = backend(cache_bytes=int(one * 1.5)), backend(cache_bytes=None)
    cached.forward_at(tokens(1), keep=(ME, "mb-1"))
    cached.forward_at(tokens(2), keep=(ME, "mb-2"))
    assert (len(cached.cache), cached.cache.evictions) == (1, 1)
    assert cached.cache.bytes_held <= cached.cache.max_bytes
    grad = torch.randn(2, 8, 16)
    first = cached.backward(tokens(1), grad, forward_step=0, key=(ME, "mb-1"))  # evicted: recomputed
    assert not first.cached and cached.cache.misses == 1
    plain.backward(tokens(1), grad, forward_step=0)
    for a, b in zip(grads(cached), grads(plain)):
        assert torch.equal(a, b)
    assert cached.backward(tokens(2), grad, forward_step=0, key=(ME, "mb-2")).cached


def test_a_graph_larger_than_the_cache_is_not_kept():
    b = backend(cache_bytes=10)
    b.forward_at(tokens(1), keep=(ME, "mb-1"))
    assert (len(b.cache), b.cache.bytes_held, b.cache.evictions) == (0, 0, 1)
    assert not b.backward(tokens(1), torch.ones(2, 8, 16), key=(ME, "mb-1")).cached


def test_graphs_expire():
    now = [0.0]
    b = backend(ttl=5.0, clock=lambda: now[0])
    b.forward_at(tokens(1), keep=(ME, "mb-1"))
    now[0] = 6.0
    b.cache.expire()
    assert (len(b.cache), b.cache.bytes_held, b.cache.evictions) == (0, 0, 1)


def test_a_graph_is_only_used_by_its_caller_and_for_the_same_input():
    b = backend()
    b.forward_at(tokens(1), keep=(ME, "mb-1"))
    assert not b.backward(tokens(1), torch.ones(2, 8, 16), key=(OTHER, "mb-1")).cached  # another peer's id
    b.forward_at(tokens(1), keep=(ME, "mb-2"))
    plain = backend(cache_bytes=None)
    plain.backward(tokens(3), torch.ones(2, 8, 16))
    for p in b.optimizer.params:
        p.grad = None
    b.optimizer.samples = 0
    result = b.backward(tokens(3), torch.ones(2, 8, 16), key=(ME, "mb-2"))  # other tokens than the forward's
    assert not result.cached
    for a, c in zip(grads(b), grads(plain)):
        assert torch.equal(a, c)


def step_with_others(b: StageBackend, *seeds: int) -> None:
    """A batch of 4 from other micro-batches (2 each) steps the stage once per two seeds."""
    for seed in seeds:
        b.backward(tokens(seed), torch.ones(2, 8, 16))
    for p in b.optimizer.params:
        p.grad = None


def test_a_graph_built_before_a_step_serves_its_backward_after_it_with_the_gradient_of_then():
    """The kept graph ran on a frozen copy of the parameters, which the step left as they were: the backward
    one step late starts from it (no forward again), with the gradient the stash would give, bit for bit."""
    b, stashing = backend(), backend(cache_bytes=None)  # the second recomputes on its stash, as before graphs lasted
    then = copy.deepcopy(b.module)
    x = tokens(6)
    h, forward_step = b.forward_at(x, keep=(ME, "late"))
    stashing.forward_at(x)
    for backend_ in (b, stashing):
        step_with_others(backend_, 7, 8)
        assert backend_.step == 1
    grad = torch.randn_like(h)
    result = b.backward(x, grad, forward_step=forward_step, key=(ME, "late"))
    recomputed = stashing.backward(x, grad, forward_step=forward_step)
    assert result.stashed and result.cached and result.staleness == 1
    assert recomputed.stashed and not recomputed.cached
    for a, c in zip(grads(b), grads(stashing)):
        assert torch.equal(a, c)
    then(x).backward(grad)
    for param, expected in zip(b.optimizer.params, then.parameters()):
        torch.testing.assert_close(param.grad, expected.grad)


def test_a_graph_two_steps_old_is_not_used_and_graphs_on_older_copies_are_freed():
    b = backend()
    x = tokens(6)
    h, forward_step = b.forward_at(x, keep=(ME, "two-late"))
    step_with_others(b, 7, 8)
    b.forward_at(tokens(9), keep=(ME, "one-late"))  # on the copy of step 1
    assert len(b.cache) == 2
    step_with_others(b, 10, 11)
    assert b.step == 2
    b.forward_at(tokens(12), keep=(ME, "fresh"))  # a copy of step 2: the graph on step 0's copy can serve nothing
    assert len(b.cache) == 2 and b.cache.evictions == 1
    now = copy.deepcopy(b.module)
    grad = torch.randn_like(h)
    late = b.backward(x, grad, forward_step=forward_step, key=(ME, "two-late"))
    assert not late.cached and not late.stashed and late.staleness == 2  # recomputed on the parameters of now
    now(x).backward(grad)
    for param, expected in zip(b.optimizer.params, now.parameters()):
        torch.testing.assert_close(param.grad, expected.grad)
    one_late = b.backward(tokens(9), torch.ones(2, 8, 16), forward_step=1, key=(ME, "one-late"))
    assert one_late.cached and one_late.stashed
    assert b.backward(tokens(12), torch.ones(2, 8, 16), forward_step=2, key=(ME, "fresh")).cached


def test_without_stashing_a_graph_built_before_a_step_is_not_used():
    run = config()
    module = build_stage(run, 0)
    b = StageBackend(module, StageOptimizer(module, run.optimizer), cache=ActivationCache(1 << 30),
                     stash_weights=False)
    x = tokens(6)
    h, forward_step = b.forward_at(x, keep=(ME, "late"))
    step_with_others(b, 7, 8)
    result = b.backward(x, torch.randn_like(h), forward_step=forward_step, key=(ME, "late"))
    assert not result.cached and not result.stashed and result.staleness == 1


def test_parameters_changed_in_place_without_a_step_make_the_graph_stale_and_it_is_recomputed():
    b, plain = backend(), backend(cache_bytes=None)
    b.forward_at(tokens(1), keep=(ME, "mb-1"))
    with torch.no_grad():  # e.g. a state loaded from a peer at the same step
        for module in (b, plain):
            module.optimizer.params[1].mul_(0.5)
    result = b.backward(tokens(1), torch.ones(2, 8, 16), key=(ME, "mb-1"))
    plain.backward(tokens(1), torch.ones(2, 8, 16))
    assert not result.cached
    for a, c in zip(grads(b), grads(plain)):
        assert torch.equal(a, c)


def test_saved_bytes_counts_activations_once_and_not_parameters():
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with SavedBytes(list(linear.parameters())) as saved:
        torch.relu(linear(x)).sum()
    assert saved.nbytes == 2 * 3 * 4 * 4  # the input and the relu's output, float32; the weight not at all


def test_bfloat16_compute_keeps_float32_weights_gradients_and_moments_and_matches_plain_autocast():
    run = config(compute_dtype="bfloat16")
    b = backend(run=run)
    assert b.compute_dtype == torch.bfloat16
    reference = build_stage(run, 0)
    x, grad = tokens(1), torch.randn(2, 8, 16)
    out, _ = b.forward_at(x, keep=(ME, "mb"))
    b.backward(x, grad, key=(ME, "mb"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x)
    expected.backward(grad)
    torch.testing.assert_close(out, expected.detach(), atol=0, rtol=0)
    for p, q in zip(b.optimizer.params, reference.parameters()):
        assert p.dtype == p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad)
    b.backward(tokens(2), grad)  # 4 samples: a step
    assert b.step == 1
    moments = [v for state in b.optimizer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    assert moments and all(m.dtype == torch.float32 for m in moments if m.dim() > 0)


def test_compute_dtypes():
    assert resolve_compute_dtype("auto", "cpu") == torch.float32
    assert resolve_compute_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="loss scaling"):
        resolve_compute_dtype(torch.float16, "cpu")
    with pytest.raises(ConfigError, match="loss scaling"):
        config(compute_dtype="float16")
    assert config().stages.wire == "float32"
    assert config(compute_dtype="bfloat16").stages.wire == "bfloat16"
    assert config(compute_dtype="bfloat16", wire_dtype="float32").stages.wire == "float32"


def test_a_caller_flooding_the_cache_evicts_its_own_graphs_not_others():
    cache = ActivationCache(max_bytes=1000, ttl=60.0, clock=lambda: 0.0)
    t = torch.zeros(1)

    def put(caller: str, request: str, nbytes: int = 100) -> bool:
        return cache.put((caller, request), t, t, 0, (), nbytes)

    put("honest", "a")
    put("honest", "b")
    for i in range(30):  # a stranger's forwards that announce a backward and never send it
        assert put("stranger", f"x{i}")
    assert cache.bytes_held <= 1000
    assert cache.take(("honest", "a")) is not None and cache.take(("honest", "b")) is not None
    assert len(cache) == 8 and cache.take(("stranger", "x21")) is None and cache.take(("stranger", "x29")) is not None
    # one caller alone: oldest first, as before
    alone = ActivationCache(max_bytes=300, ttl=60.0, clock=lambda: 0.0)
    for i in range(5):
        alone.put(("me", i), t, t, 0, (), 100)
    assert [alone.take(("me", i)) is not None for i in range(5)] == [False, False, True, True, True]
    assert alone.bytes_held == 0 and alone.put(("me", "empty"), t, t, 0, (), 0)


def _tensor_bytes_reachable() -> int:
    """Bytes of the distinct storages of every tensor the Python collector can reach from anywhere."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.layout == torch.strided:  # type(): no lazy module imports
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_graphs_dropped_from_the_cache_free_their_activations():
    """A graph dropped from the cache (evicted, expired, never backwarded) is freed, not leaked.

    Saved tensors are kept detached (SavedBytes._pack): a saved output kept as itself refers to its
    own autograd node, a cycle through C++ that Python's collector never frees, and with it every
    activation the graph saved. 60 graphs go through a cache with room for one; afterwards the
    tensor bytes still reachable must be what they were before, give or take one graph.
    """
    b = backend()
    b.forward_at(tokens(0), keep=(ME, "probe"))
    one = b.cache.bytes_held
    b.cache = ActivationCache(int(one * 1.5))  # room for one graph: every forward evicts the one before
    before = _tensor_bytes_reachable()
    graphs = 60
    for i in range(graphs):
        b.forward_at(tokens(i), keep=(ME, f"mb-{i}"))
    assert (len(b.cache), b.cache.evictions) == (1, graphs - 1)
    b.cache.discard((ME, f"mb-{graphs - 1}"))
    grown = _tensor_bytes_reachable() - before
    assert grown <= one, f"{graphs} dropped graphs of {one} bytes each left {grown} bytes of tensors reachable"


def test_a_backward_during_a_rounds_look_ahead_and_after_its_step_takes_the_gradient_of_its_forwards_parameters():
    """A round's look-ahead changes the parameters in place without a step. A backward of a forward kept before
    it, whether it comes during the round or after the round's step, gets the gradient of the parameters that
    forward ran on (its graph), not of the look-ahead ones: recomputed there, the gradient would not be of the
    output the next stage saw."""
    b = backend()
    then = copy.deepcopy(b.module)
    grad_out = hidden(9)
    _, early = b.forward_at(tokens(1), keep=(ME, "during"))
    _, late = b.forward_at(tokens(2), keep=(ME, "after"))
    look_ahead = [p.detach() * 0.5 for p in b.optimizer.params]
    with torch.no_grad():  # what StageState.enter_look_ahead does
        for p, value in zip(b.optimizer.params, look_ahead):
            p.copy_(value)
    b.in_look_ahead = lambda: True
    assert b.forward_at(tokens(3), keep=(ME, "on the look-ahead")).ahead  # (on a new frozen copy)
    during = b.backward(tokens(1), grad_out, forward_step=early, key=(ME, "during"))
    assert during.cached and during.staleness == 0
    got_during = grads(b)
    b.optimizer.zero_grad()
    b.in_look_ahead = lambda: False
    step_with_others(b, 7, 8)  # (the round's step)
    b.forward_at(tokens(4), keep=(ME, "after the step"))  # (a copy of the step's parameters: the others stay)
    after = b.backward(tokens(2), grad_out, forward_step=late, key=(ME, "after"))
    assert after.cached and after.stashed and after.staleness == 1
    for seed, got in ((1, got_during), (2, grads(b))):
        then.zero_grad(set_to_none=True)
        then(tokens(seed)).backward(grad_out)
        for g, p in zip(got, then.parameters()):
            torch.testing.assert_close(g, p.grad)


def test_a_backward_whose_forward_ran_on_another_replica_takes_the_steps_parameters_not_the_look_ahead():
    """A backward may come to a replica that did not run its forward (the trainer sends it where it will be
    answered first). During this replica's round its module holds look-ahead parameters; a forward of the same step
    run elsewhere, before that replica's own round, ran on the step's parameters: the recomputation takes those
    (StageState.lookahead_base), or the gradient would not be of the output the next stage saw. A forward that ran
    here on the look-ahead, its graph gone, is recomputed on the look-ahead as before."""
    b = backend()
    then = copy.deepcopy(b.module)
    base = [p.detach().clone() for p in b.optimizer.params]
    grad_out = hidden(9)
    with torch.no_grad():  # what StageState.enter_look_ahead does
        for p in b.optimizer.params:
            p.mul_(0.5)
    b.in_look_ahead, b.base_params = (lambda: True), (lambda: base)
    b.forward_at(tokens(2), keep=(ME, "here, ahead"))
    b.cache.discard((ME, "here, ahead"))  # (its graph gone: recomputed)
    ahead = copy.deepcopy(b.module)
    elsewhere = b.backward(tokens(1), grad_out, forward_step=b.step, key=(OTHER, "elsewhere"))
    assert not elsewhere.cached and not elsewhere.ahead
    got_elsewhere = grads(b)
    b.optimizer.zero_grad()
    here = b.backward(tokens(2), grad_out, forward_step=b.step, key=(ME, "here, ahead"))
    assert not here.cached and here.ahead
    for model, seed, got in ((then, 1, got_elsewhere), (ahead, 2, grads(b))):
        model.zero_grad(set_to_none=True)
        model(tokens(seed)).backward(grad_out)
        for g, p in zip(got, model.parameters()):
            torch.testing.assert_close(g, p.grad)
    # counted: the first fresh on its step's parameters, the second on a prediction (here, with no round, early)
    assert b.delays.samples[(False, 0)] == 2 and sum(n for (ahead, _), n in b.delays.samples.items() if ahead) == 2
