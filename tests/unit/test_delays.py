"""GradientDelays: how old each counted sample's parameters were against the step it counts in."""

from swarm.delays import MAX_TRACKED, GradientDelays


def test_a_sample_counted_in_the_step_its_parameters_make_is_fresh():
    delays = GradientDelays()
    delays.forwarded("a", ahead=False)
    delays.counted("a", forward_step=3, ahead_now=False, step=3, lands=1, n=8)  # forward at 3, counts in step 4
    assert delays.samples == {(False, 0): 8}


def test_a_sample_whose_forward_ran_before_a_step_it_does_not_count_in_is_a_step_behind():
    delays = GradientDelays()
    delays.forwarded("stashed", ahead=False)
    delays.forwarded("held", ahead=False)
    delays.counted("stashed", forward_step=3, ahead_now=False, step=4, lands=1, n=8)  # backward after step 4
    delays.counted("held", forward_step=3, ahead_now=False, step=3, lands=2, n=8)  # a round ran: counts in step 5
    assert delays.samples == {(False, 1): 16}


def test_a_forward_ahead_is_fresh_in_the_step_after_the_one_it_predicted_and_early_in_that_one():
    delays = GradientDelays()
    delays.forwarded("late", ahead=True)
    delays.forwarded("early", ahead=True)
    delays.counted("late", forward_step=3, ahead_now=False, step=3, lands=2, n=8)  # on a prediction of 4's, in 5
    delays.counted("early", forward_step=3, ahead_now=False, step=3, lands=1, n=8)  # the same, but in step 4
    assert delays.samples == {(True, 0): 8, (True, -1): 8}


def test_the_last_stage_says_at_its_backward_whether_it_ran_ahead_and_lateness_is_capped():
    delays = GradientDelays()
    delays.counted(None, forward_step=3, ahead_now=True, step=3, lands=2, n=8)
    delays.counted("never forwarded here", forward_step=0, ahead_now=False, step=9, lands=1, n=8)
    assert delays.samples == {(True, 0): 8, (False, 2): 8}
    summary = delays.summary()
    assert summary.startswith("of 16 samples, fresh 50% (50% on a prediction)") and "two or more 50%" in summary


def test_forwards_whose_backward_never_comes_are_forgotten_beyond_a_bound():
    delays = GradientDelays()
    for i in range(MAX_TRACKED + 10):
        delays.forwarded(i, ahead=True)
    delays.counted(0, forward_step=0, ahead_now=False, step=0, lands=1, n=1)  # (forgotten: taken as not ahead)
    assert delays.samples == {(False, 0): 1}
    assert GradientDelays().summary() == "no samples counted"


def test_a_server_exports_its_gradient_delays_by_steps_behind_and_whether_they_ran_ahead():
    from types import SimpleNamespace

    from swarm.serving.metrics import ComputeCollector

    delays = GradientDelays()
    delays.counted(None, forward_step=2, ahead_now=False, step=2, lands=1, n=8)
    delays.counted(None, forward_step=2, ahead_now=False, step=3, lands=1, n=4)
    delays.counted(None, forward_step=2, ahead_now=True, step=2, lands=1, n=2)
    backend = SimpleNamespace(cpu_seconds=0.0, forwards_ahead=0, delays=delays)
    families = {f.name: f for f in ComputeCollector(lambda: backend).collect()}
    got = {(s.labels["behind"], s.labels["ahead"]): s.value
           for s in families["swarm_server_gradient_delay_samples"].samples}
    assert got == {("0", "false"): 8, ("1", "false"): 4, ("-1", "true"): 2}
    assert not list(next(f for f in ComputeCollector(lambda: None).collect()
                         if f.name == "swarm_server_gradient_delay_samples").samples)
