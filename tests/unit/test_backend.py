"""StageBackend: recomputed backward equals plain autograd; bad input changes nothing."""

import copy
import threading
import time

import pytest
import torch

from swarm.backend import StageBackend
from swarm.config import RunConfig
from swarm.model import build_stage, build_stages
from swarm.optim import StageOptimizer
from swarm.protocol import BACKWARD, FORWARD
from swarm.worker import (
    AUTO_WAIT_FLOOR,
    AUTO_WAIT_FORWARDS,
    AUTO_WAIT_MIN_SERVERS,
    Overloaded,
    Worker,
    auto_max_wait,
    seed_means,
    wait_ahead,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(60)


def tiny_config() -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 8},
            "stages": {"num_stages": 2},
            "optimizer": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 0},
        }
    )


def make_backends(config):
    backends = []
    for stage in build_stages(config):
        backends.append(StageBackend(stage, StageOptimizer(stage, config.optimizer)))
    return backends


def batch(seed, n=2, t=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, t), generator=g)
    return x, torch.randint(0, 256, (n, t), generator=g)


def test_pipeline_step_matches_plain_autograd():
    config = tiny_config()
    first, last = make_backends(config)
    ref = build_stages(config)
    ref_opts = [StageOptimizer(s, config.optimizer) for s in ref]
    results = []
    for seed in (1, 2):  # two micro-batches of 2 = one batch of 4: both stages step once
        x, y = batch(seed)
        h = first.forward(x)
        res_last = last.backward(h, targets=y)
        res_first = first.backward(x, grad_output=res_last.grad_input)
        results.append((res_first, res_last))
        loss = ref[1](ref[0](x), y)
        (loss * x.shape[0]).backward()
        assert res_last.loss == pytest.approx(float(loss.detach()), rel=1e-6)
        for opt in ref_opts:
            opt.add_samples(x.shape[0])
    for opt in ref_opts:
        opt.step()
    assert results[0][0].step_stats is None and results[1][0].step_stats is not None
    assert first.step == last.step == 1
    for backend, module in zip((first, last), ref):
        for (name, p), q in zip(backend.module.named_parameters(), module.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


def test_bad_gradient_is_rejected_and_changes_nothing():
    config = tiny_config()
    first, _ = make_backends(config)
    before = {k: v.clone() for k, v in first.module.state_dict().items()}
    x, _ = batch(3)
    h = first.forward(x)
    for grad, match in [
        (None, "needs the gradient"),
        (torch.zeros(2, 8, 15), "shape"),
        (torch.full_like(h, float("nan")), "non-finite"),
        (torch.zeros(2, 8, 16, dtype=torch.long), "floating-point"),
    ]:
        with pytest.raises(ValueError, match=match):
            first.backward(x, grad_output=grad)
    assert first.optimizer.samples == 0
    first.module.zero_grad(set_to_none=True)
    for k, v in first.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_queue_is_bounded():
    config = tiny_config()
    stage = build_stage(config, 0)
    backend = StageBackend(stage, StageOptimizer(stage, config.optimizer), max_queue=2)
    gate = threading.Event()
    blocked = [backend.submit(gate.wait, 30), backend.submit(gate.wait, 30)]
    with pytest.raises(Overloaded):
        backend.submit(gate.wait, 30)
    gate.set()
    assert all(f.result(timeout=30) for f in blocked)
    assert backend.call(lambda: backend.queue_depth, timeout=30) == 1  # only this call is queued
    backend.shutdown()


def test_expected_wait_counts_the_tasks_ahead_at_their_kinds_mean_time_and_what_the_running_one_has_left():
    worker, gate = Worker("w", max_queue=8), threading.Event()
    try:
        assert worker.expected_wait() == 0.0  # nothing queued
        worker.submit(time.sleep, 0.05, kind=FORWARD).result(timeout=30)
        worker.submit(time.sleep, 0.1, kind=BACKWARD).result(timeout=30)
        forward, backward = worker.task_seconds[FORWARD], worker.task_seconds[BACKWARD]
        assert 0.05 <= forward < backward
        assert worker.expected_wait() == 0.0  # nothing queued: a task given now starts at once
        started = threading.Event()
        held = worker.submit(lambda: (started.set(), gate.wait(30)), kind=BACKWARD)
        assert started.wait(30)
        ahead = [worker.submit(lambda: None, kind=k) for k in (FORWARD, FORWARD, BACKWARD)]
        ahead.append(worker.submit(lambda: None))  # a kind not timed yet: taken as long as the longest timed
        queued = 2 * forward + 2 * backward
        assert queued <= worker.expected_wait() <= queued + backward  # and up to a backward's mean for the held one
        # the held task has outrun its kind's mean: only those queued behind it count now (the means stand until a
        # task ends)
        wait_until(lambda: worker.expected_wait() == pytest.approx(queued), 30,
                   what="the held task to outrun the mean")
        gate.set()
        held.result(timeout=30)
        for future in ahead:
            future.result(timeout=30)
        wait_until(lambda: worker.queue_depth == 0, 30, what="the queue to empty")
        assert worker.expected_wait() == 0.0
        assert worker.task_seconds[BACKWARD] != backward  # the held one moved its kind's mean
    finally:
        gate.set()
        worker.shutdown()


def test_wait_ahead_by_hand_and_the_seeds_a_stage_starts_with():
    means = {FORWARD: 1.0, BACKWARD: 2.0}
    assert wait_ahead({}, {}, None) == 0.0  # no mean: nothing to go by
    assert wait_ahead({FORWARD: 2, BACKWARD: 1}, means, None) == 4.0
    assert wait_ahead({FORWARD: 1, "other": 1}, means, (BACKWARD, 0.5)) == 1.0 + 2.0 + 1.5
    assert wait_ahead({}, means, (FORWARD, 3.0)) == 0.0  # outran its mean: nothing left counted
    assert seed_means(3.0, last=False) == {FORWARD: 1.0, BACKWARD: 2.0}
    assert seed_means(3.0, last=True) == {FORWARD: 1.0, BACKWARD: 3.0}


def test_a_backward_that_fails_midway_leaves_the_accumulated_gradients_as_they_were():
    config = tiny_config()
    first, last = make_backends(config)
    x, y = batch(4)
    h = first.forward(x)
    first.backward(x, grad_output=torch.ones_like(h))
    kept = [p.grad.clone() for p in first.optimizer.params]

    def fail(_):
        raise RuntimeError("device lost")

    hook = first.optimizer.params[0].register_hook(fail)  # the embedding: autograd reaches it last
    with pytest.raises(RuntimeError, match="device lost"):
        first.backward(x, grad_output=torch.ones_like(h))
    hook.remove()
    assert first.optimizer.samples == 2
    for param, grad in zip(first.optimizer.params, kept):
        assert torch.equal(param.grad, grad)


def test_backward_reports_how_stale_its_gradient_is():
    config = tiny_config()
    first, last = make_backends(config)
    x, y = batch(5)
    h = first.forward(x)
    assert first.backward(x, grad_output=torch.ones_like(h), forward_step=0).staleness == 0
    assert first.backward(x, grad_output=torch.ones_like(h), forward_step=0).step == 1  # a batch of 4: stepped
    assert first.backward(x, grad_output=torch.ones_like(h), forward_step=0).staleness == 1
    assert first.backward(x, grad_output=torch.ones_like(h)).staleness is None  # an older trainer sends none


def forward_then_a_step(first: StageBackend) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A micro-batch's forward at step 0, then a batch of other micro-batches steps the stage to 1: the
    micro-batch, the gradient its backward brings, and its forward's step."""
    x, _ = batch(6)
    h, forward_step = first.forward_at(x)
    grad = torch.randn_like(h)
    for seed in (7, 8):  # a batch of 4 from other micro-batches: the stage steps to 1
        other, _ = batch(seed)
        first.backward(other, grad_output=torch.ones_like(h))
    assert (forward_step, first.step) == (0, 1)
    return x, grad, forward_step


def test_a_backward_one_step_late_uses_the_parameters_its_forward_used():
    config = tiny_config()
    first, _ = make_backends(config)
    then = copy.deepcopy(first.module)  # the parameters at step 0
    x, grad, forward_step = forward_then_a_step(first)

    result = first.backward(x, grad_output=grad, forward_step=forward_step)
    assert result.stashed and result.staleness == 1
    then(x).backward(grad)
    for param, expected in zip(first.optimizer.params, then.parameters()):
        torch.testing.assert_close(param.grad, expected.grad)
    assert not any(torch.equal(p, q) for p, q in zip(first.optimizer.params, then.parameters()) if p.dim() > 1)

    first.backward(x, grad_output=grad, forward_step=forward_step)  # the step: 4 samples; stash now holds step 1
    assert not first.backward(x, grad_output=grad, forward_step=0).stashed  # two steps old: recomputed on now's


def test_utilization_is_the_share_of_wall_time_the_worker_computed():
    backend = make_backends(tiny_config())[0]
    try:
        assert backend.utilization() < 0.5  # just built: nothing computed yet

        def spin(seconds: float) -> None:  # compute, not a sleep: the worker is busy throughout
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        backend.call(lambda: spin(0.3), timeout=10)
        assert 0.5 < backend.utilization() <= 1.0
    finally:
        backend.shutdown()


def test_an_injected_slowdown_holds_the_worker_that_many_times_as_long_as_a_task_computed():
    worker = Worker("slow", 4, slowdown=3.0)
    try:
        def timed() -> tuple[float, float]:
            began = time.perf_counter()
            end = began + 0.05
            while time.perf_counter() < end:
                pass
            return began, time.perf_counter()

        first, second = worker.submit(timed), worker.submit(timed)
        (began, ended), (next_began, _) = first.result(timeout=30), second.result(timeout=30)
        # the next task waits out 2 more times what the first computed (at least: a loaded machine adds)
        assert next_began - ended >= 2 * (ended - began)
        assert worker.busy_seconds >= 3 * 2 * 0.05
    finally:
        worker.shutdown()
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="slowdown"):
            Worker("bad", 4, slowdown=bad)


def test_without_weight_stashing_a_backward_one_step_late_uses_the_parameters_of_now():
    config = tiny_config()
    stage = build_stages(config)[0]
    first = StageBackend(stage, StageOptimizer(stage, config.optimizer), stash_weights=False)
    x, grad, forward_step = forward_then_a_step(first)
    now = copy.deepcopy(first.module)  # the parameters at step 1
    for p in now.parameters():
        p.grad = None

    result = first.backward(x, grad_output=grad, forward_step=forward_step)
    assert not result.stashed and result.staleness == 1
    now(x).backward(grad)
    for param, expected in zip(first.optimizer.params, now.parameters()):
        torch.testing.assert_close(param.grad, expected.grad)


def test_cpu_seconds_count_the_workers_cpu_time_not_its_waits():
    backend = make_backends(tiny_config())[0]
    try:
        def spin(seconds: float) -> None:  # on the worker's own CPU clock: a loaded machine stretches it, not this
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass

        backend.call(lambda: spin(0.2), timeout=30)
        spun = backend.cpu_seconds
        assert spun >= 0.2
        backend.call(lambda: threading.Event().wait(0.3), timeout=30)  # waiting costs no CPU
        assert backend.cpu_seconds - spun < 0.1 and backend.busy_seconds >= 0.5
    finally:
        backend.shutdown()


def test_a_forward_whose_backward_comes_after_the_step_runs_on_the_predicted_parameters():
    # batch 4 of micro-batches of 2: a has been through, b is in flight and fills the batch, so c's
    # backward comes after the step: c runs ahead, on the parameters the step is predicted to make
    config = tiny_config()
    stage = build_stages(config)[0]
    first = StageBackend(stage, StageOptimizer(stage, config.optimizer))
    assert first.ahead
    (xa, _), (xc, _) = batch(1), batch(3)
    grad = torch.randn(2, 8, config.model.d_model, generator=torch.Generator().manual_seed(7))
    first.forward_at(xa, keep="a")
    first.backward(xa, grad_output=grad, forward_step=0, key="a")
    predicted = first.optimizer.preview([p.grad.clone() for p in first.optimizer.params], 2)
    assert not first.forward_at(xa, keep="b").ahead  # the same samples as a: the step's mean gradient is a's
    forwarded = first.forward_at(xc, keep="c")
    _, step = forwarded
    assert first.forwards_ahead == 1 and step == 0 and forwarded.ahead  # its reply says: on a prediction
    result_b = first.backward(xa, grad_output=grad, forward_step=0, key="b")
    assert result_b.step_stats is not None and not result_b.stashed
    for param, expected in zip(first.optimizer.params, predicted):  # the prediction was the step
        torch.testing.assert_close(param.detach(), expected)

    at_prediction = copy.deepcopy(stage)
    with torch.no_grad():
        for param, value in zip(at_prediction.parameters(), predicted):
            param.copy_(value)
    out, _ = first.forward_at(xc)
    torch.testing.assert_close(out, at_prediction(xc).detach())  # (the forward of c ran there too)
    first.optimizer.zero_grad()
    result = first.backward(xc, grad_output=grad, forward_step=0, key="c")
    assert result.stashed and result.staleness == 1
    at_prediction(xc).backward(grad)
    for param, expected in zip(first.optimizer.params, at_prediction.parameters()):
        torch.testing.assert_close(param.grad, expected.grad)
    first.shutdown()


class DueOptimizer(StageOptimizer):
    """A stage optimizer that can be told the stage's batch is due (as a replica learns from its peers)."""

    due = False

    def samples_to_step(self):
        return 0 if self.due else super().samples_to_step()

    def accumulate(self, grads, n, awaited=False, predicted=False):
        self.last = [None if g is None else g.clone() for g in grads]
        self.last_predicted = predicted
        return super().accumulate(grads, n, awaited, predicted)


def test_a_forward_ahead_whose_backward_comes_before_the_step_is_counted_a_step_early():
    # as above, but c's backward comes back before b's: it counts in this batch, and its gradient (of the
    # parameters the step makes) is a step early; the count of gradient delays says so
    config = tiny_config()
    stage = build_stages(config)[0]
    first = StageBackend(stage, StageOptimizer(stage, config.optimizer))
    (xa, _), (xb, _), (xc, _) = batch(1), batch(2), batch(3)
    grad = torch.randn(2, 8, config.model.d_model, generator=torch.Generator().manual_seed(7))
    first.forward_at(xa, keep="a")
    first.backward(xa, grad_output=grad, forward_step=0, key="a")
    first.forward_at(xb, keep="b")
    assert first.forward_at(xc, keep="c").ahead
    result_c = first.backward(xc, grad_output=grad, forward_step=0, key="c")
    assert first.optimizer.samples == 4 and result_c.ahead  # a and c: this batch (the drain waits for b's)
    assert first.delays.samples == {(False, 0): 2, (True, -1): 2}
    first.shutdown()


def test_on_the_last_stage_a_backward_while_the_batch_is_due_runs_on_the_predicted_parameters():
    config = tiny_config()
    stage = build_stages(config)[1]
    optimizer = DueOptimizer(stage, config.optimizer)
    last = StageBackend(stage, optimizer)
    (ha, ya), (hc, yc) = [(torch.randn(2, 8, config.model.d_model, generator=torch.Generator().manual_seed(s)),
                           batch(s)[1]) for s in (1, 3)]
    last.backward(ha, targets=ya)  # 2 of the batch's 4 samples: nothing predicted yet
    assert last.forwards_ahead == 0
    predicted = optimizer.preview([p.grad.clone() for p in optimizer.params], 2)
    optimizer.due = True  # the other replica filled the batch: these samples count towards the step after
    result = last.backward(hc, targets=yc)
    assert last.forwards_ahead == 1 and not result.stashed and result.ahead
    # computed on the step's prediction and counted in it (a lone optimizer told the batch is due): a step early
    assert optimizer.last_predicted and optimizer.step_count == 1  # (counted in this batch, which stepped)
    assert last.delays.samples == {(False, 0): 2, (True, -1): 2}

    at_prediction = copy.deepcopy(stage)
    with torch.no_grad():
        for param, value in zip(at_prediction.parameters(), predicted):
            param.copy_(value)
    (at_prediction(hc, targets=yc) * 2).backward()
    assert result.loss == pytest.approx(float(at_prediction(hc, targets=yc).detach()), rel=1e-5)
    for got, expected in zip(optimizer.last, at_prediction.parameters()):
        torch.testing.assert_close(got, expected.grad)
    last.shutdown()


@pytest.mark.parametrize("weight", [0.0, 0.5, 1.0])
def test_a_weighted_backward_counts_as_that_share_of_its_samples(weight):
    """A backward of weight w counts as round(w x n) samples, its gradient scaled alike (a weighted mean of the
    batch's micro-batches); 0 counts nothing. The gradient of the input is the same whatever the weight."""
    config = tiny_config()
    first, last = make_backends(config)
    x, y = batch(3)  # (2 samples of the batch's 4: no step)
    h = first.forward(x)
    grad = last.backward(h, targets=y).grad_input
    plain = build_stage(config, 0)
    plain.load_state_dict(first.module.state_dict())
    plain_opt = StageOptimizer(plain, config.optimizer)
    torch.autograd.backward(plain(x), grad)
    expected = [p.grad * weight for p in plain_opt.params]
    result = first.backward(x, grad_output=grad, weight=weight)
    assert result.grad_input is None  # (stage 0 takes tokens)
    assert first.optimizer.samples == round(weight * 2)
    for p, g in zip(first.optimizer.params, expected):
        if weight == 0:
            assert p.grad is None or not p.grad.any()
        else:
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def test_while_its_round_runs_on_look_ahead_parameters_every_reply_says_ahead():
    config = tiny_config()
    backends = make_backends(config)
    x, y = batch(1)
    h = backends[0].forward_at(x)
    assert not h.ahead and not backends[1].backward(h[0], targets=y).ahead
    for backend in backends:  # as StageServer wires it to its StageState (lookahead_base set during a round)
        backend.in_look_ahead = lambda: True
    assert backends[0].forward_at(x).ahead and backends[1].backward(h[0], targets=y).ahead
    for backend in backends:
        backend.shutdown()


def test_the_auto_wait_limit_is_a_share_of_a_forward_of_the_stages_median_server_by_hand():
    assert (AUTO_WAIT_FORWARDS, AUTO_WAIT_FLOOR, AUTO_WAIT_MIN_SERVERS) == (0.3, 0.5, 3)  # the figures below use these
    # a forward takes this server 4 s at 10 samples/s; the stage's median claim is 20: its median server's forward
    # takes 2 s, and 0.3 of it is 0.6 s
    assert auto_max_wait(4.0, 10.0, [10.0, 20.0, 40.0]) == pytest.approx(0.6)
    assert auto_max_wait(4.0, 40.0, [10.0, 20.0, 40.0]) == pytest.approx(2.4)  # a fast server taking 4 s: slow stage
    assert auto_max_wait(0.1, 10.0, [10.0, 20.0, 40.0]) == AUTO_WAIT_FLOOR  # never below the floor
    # a liar's claim among honest ones does not move the median past an honest server's
    assert auto_max_wait(8.0, 10.0, [10.0, 20.0, 40.0, 1e12]) == pytest.approx(0.3 * 8.0 * 10.0 / 30.0)
    # claims that are not throughputs are left out; fewer than three servers in the stage, or not measured yet: no
    # limit (a refusal would leave a stage of two to one server for that trainer)
    assert auto_max_wait(4.0, 10.0, [10.0, 20.0, 0.0, float("nan"), float("inf"), -5.0]) is None
    assert auto_max_wait(4.0, 10.0, [10.0]) is None
    assert auto_max_wait(None, 10.0, [10.0, 20.0]) is None
    assert auto_max_wait(4.0, 0.0, [10.0, 20.0]) is None
