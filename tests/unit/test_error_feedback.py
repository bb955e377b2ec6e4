"""ErrorFeedback: what the codec rounds off a pseudo-gradient goes with the next one, only once a round took it."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.compression import CompressionInfo

from swarm.averaging.codecs import Float8Codec, float8_grid, grid_for
from swarm.averaging.feedback import ErrorFeedback
from swarm.config import AveragingConfig, ConfigError

pytestmark = pytest.mark.timeout(60)


def pseudo_gradient(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(300, generator=g) * 1e-3, torch.randn(4, 50, generator=g) * 1e-5]


def copies(tensors):
    return [t.clone() for t in tensors]


def test_sent_is_on_the_codec_grid_and_the_residual_is_what_it_left_out():
    feedback = ErrorFeedback(float8_grid)
    delta = pseudo_gradient(0)
    whole, sent = feedback.prepare(copies(delta))
    codec = Float8Codec()
    for d, w, s in zip(delta, whole, sent):
        torch.testing.assert_close(w, d, rtol=0, atol=0)  # no residual yet: whole is the pseudo-gradient
        assert torch.equal(codec.extract(codec.compress(s, CompressionInfo.from_tensor(s))), s)
        assert not torch.equal(s, d)  # (float8 rounds these values)
    assert feedback.residual is None  # nothing owed until a round takes it
    feedback.commit()
    for d, s, r in zip(delta, sent, feedback.residual):
        assert torch.equal(r, d - s)


def test_over_rounds_everything_arrives_except_the_last_residual():
    """Sum of what was sent over R rounds = sum of the pseudo-gradients - the last residual (exactly, up to float
    addition); without feedback the rounding error grows with the rounds."""
    feedback, plain = ErrorFeedback(float8_grid), ErrorFeedback(float8_grid)
    total = [torch.zeros_like(t, dtype=torch.float64) for t in pseudo_gradient(0)]
    sent_total = copies(total)
    plain_total = copies(total)
    for r in range(20):
        delta = pseudo_gradient(r)
        for t, d in zip(total, delta):
            t += d.double()
        _, sent = feedback.prepare(copies(delta))
        feedback.commit()
        _, plain_sent = plain.prepare(copies(delta))
        plain.reset()  # (no feedback: each round's rounding error dropped)
        for st, s, pt, p in zip(sent_total, sent, plain_total, plain_sent):
            st += s.double()
            pt += p.double()
    for t, st, res in zip(total, sent_total, feedback.residual):
        torch.testing.assert_close(st + res.double(), t, rtol=1e-6, atol=1e-9)
    error = sum(float((st - t).norm() ** 2) for st, t in zip(sent_total, total)) ** 0.5
    plain_error = sum(float((pt - t).norm() ** 2) for pt, t in zip(plain_total, total)) ** 0.5
    assert error < plain_error / 3  # (measured: 0.20 of it; the one residual left against twenty roundings)


def test_a_round_that_did_not_take_it_leaves_the_residual_owed():
    feedback = ErrorFeedback(float8_grid)
    feedback.prepare(pseudo_gradient(0))
    feedback.commit()
    owed = copies(feedback.residual)
    feedback.prepare(pseudo_gradient(1))
    feedback.discard()
    assert all(torch.equal(a, b) for a, b in zip(feedback.residual, owed))
    whole, _ = feedback.prepare(pseudo_gradient(2))  # the next try carries the old residual
    for w, d, r in zip(whole, pseudo_gradient(2), owed):
        assert torch.equal(w, d + r)
    feedback.reset()
    assert feedback.residual is None and feedback.norm() == 0.0


def test_a_non_finite_pseudo_gradient_goes_as_it_is_and_keeps_the_residual():
    feedback = ErrorFeedback(float8_grid)
    feedback.prepare(pseudo_gradient(0))
    feedback.commit()
    owed = copies(feedback.residual)
    broken = pseudo_gradient(1)
    broken[0][3] = math.nan
    whole, sent = feedback.prepare(broken)
    assert sent is whole and math.isnan(float(sent[0][3]))
    feedback.commit()  # (nothing pending: a commit changes nothing)
    assert all(torch.equal(a, b) for a, b in zip(feedback.residual, owed))


def test_lossless_codec_keeps_nothing():
    feedback = ErrorFeedback(grid_for("none"))
    delta = pseudo_gradient(0)
    whole, sent = feedback.prepare(copies(delta))
    feedback.commit()
    assert sent is whole and all(torch.equal(s, d) for s, d in zip(sent, delta)) and feedback.residual is None


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8"])
def test_each_fixed_grid_goes_through_its_codec_unchanged(name):
    from swarm.averaging.codecs import compression_for

    codec, grid = compression_for(name), grid_for(name)
    x = grid(torch.randn(5000) * 1e-2)
    for part in x.split(1237):
        assert torch.equal(codec.extract(codec.compress(part, CompressionInfo.from_tensor(part))), part)


def test_blockwise8bit_has_no_grid_and_the_config_says_so():
    with pytest.raises(ValueError, match="no fixed grid"):
        grid_for("blockwise8bit")
    config = AveragingConfig(mode="local", pseudo_gradient_compression="blockwise8bit")
    with pytest.raises(ConfigError, match="float8"):
        config.validate()
    AveragingConfig(mode="local", pseudo_gradient_compression="blockwise8bit",
                    pseudo_gradient_error_feedback=False).validate()
    AveragingConfig(mode="local", pseudo_gradient_compression="float8").validate()
    with pytest.raises(ConfigError, match="true or false"):
        AveragingConfig(pseudo_gradient_error_feedback="yes").validate()
