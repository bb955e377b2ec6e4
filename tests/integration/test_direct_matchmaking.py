"""Matchmaking declarations sent straight to the stage's servers form a round's group without the DHT.

Both tests blind hivemind's DHT read of group keys (the averaging processes fork after the patch and
inherit it): with direct declarations a round still forms its group and averages; without them, the
same blinded swarm forms no group at all, which shows the blinding bites.
"""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.averaging.key_manager import GroupKeyManager

from tests.helpers import wait_until
from tests.integration.inproc import running_peers, stage_servers
from tests.integration.test_averaging import (
    ROUND_TIMEOUT,
    STAGE,
    averaged_round,
    caught_up,
    make_config,
    micro_batch,
    rounds,
    until_whole,
    wait_until_peers_see_each_other,
)

pytestmark = pytest.mark.timeout(150)


@pytest.fixture
def dht_blind_to_groups(monkeypatch):
    async def nobody(self, group_key, only_active):
        return []

    monkeypatch.setattr(GroupKeyManager, "get_averagers", nobody)


def test_with_the_dht_blind_to_groups_direct_declarations_still_form_the_round(dht_blind_to_groups):
    config = make_config("direct-on")
    with running_peers(config.run_id, 2) as peers, stage_servers(config, peers, [STAGE, STAGE]) as (a, b):
        wait_until_peers_see_each_other([a, b])
        wait_until(lambda: a.averager.group_formed_ahead and b.averager.group_formed_ahead, ROUND_TIMEOUT,
                   interval=0.1, what="the next round's group formed ahead on both servers, through declarations")
        # (hivemind can lose a member's part partway on loaded cores: then that round fails and another runs)
        until_whole([a, b], lambda seed: [[micro_batch(config, seed)],
                                          [micro_batch(config, seed + 1), micro_batch(config, seed + 2)]])
        assert all(rounds(s, "succeeded") >= 1 for s in (a, b))


def test_with_the_dht_blind_to_groups_and_no_direct_declarations_no_group_forms(dht_blind_to_groups):
    config = make_config("direct-off")
    config.averaging = dataclasses.replace(config.averaging, direct_matchmaking=False)
    config.validate()
    with running_peers(config.run_id, 2) as peers, stage_servers(config, peers, [STAGE, STAGE]) as (a, b):
        wait_until_peers_see_each_other([a, b])
        batches = [[micro_batch(config, 1)], [micro_batch(config, 2), micro_batch(config, 3)]]
        averaged_round([a, b], batches)  # no round finds anybody; then they agree
        assert [rounds(s, "succeeded") for s in (a, b)] == [0.0, 0.0]
        # Each steps alone once its tries are spent, or, if the other stepped alone first, takes its state
        # (the other is then ahead of it)
        assert max(rounds(s, "failed") for s in (a, b)) == 1.0
        assert all(rounds(s, "failed") == 1.0 or caught_up(s) >= 1 for s in (a, b))
