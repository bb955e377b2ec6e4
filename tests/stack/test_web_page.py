"""The coordinator's live page `/` in a real browser (headless system Chromium through playwright).

Against a running swarm: the page shows every stage of /status with each of its servers, marks the
bottleneck stage, counts the volunteers, draws a loss chart with points, says so when the coordinator
stops answering and recovers when it answers again. Screenshots are kept as artifacts.
"""

from __future__ import annotations

import shutil

import pytest
from playwright import sync_api  # the test-stack extra; `make test-stack` installs it

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")  # the system's: playwright cannot download

HISTORY_TIMEOUT = 240.0  # swarm up to two loss points in /status's history (first loss, then 5+ s later)
PAGE_TIMEOUT_MS = 20_000  # for the page to show what /status holds (it polls every 3 s)
NOTICE_TIMEOUT_MS = 15_000  # for the "unreachable" notice to come, and to go
TEST_TIMEOUT = HISTORY_TIMEOUT + 120

# Everything the test checks, read from the page in one go so that no poll lands in between.
SNAPSHOT = """() => ({
  rendered: Number(document.body.dataset.rendered || 0),
  volunteers: document.getElementById("volunteers").textContent,
  lossPoints: Number(document.getElementById("loss-chart").dataset.points),
  lossCanvas: (document.querySelector("#loss-chart canvas") || {width: 0}).width,
  stages: [...document.querySelectorAll("#stages .stage")].map((card) => ({
    stage: Number(card.dataset.stage),
    marked: card.dataset.bottleneck === "true",
    badge: (card.querySelector(".badge") || {textContent: null}).textContent,
    servers: [...card.querySelectorAll("tr[data-peer-id]")].map((row) => [row.dataset.peerId, row.textContent]),
  })),
})"""


def loss_points(status: dict) -> int:
    return sum(1 for loss in status.get("history", {}).get("loss", []) if loss is not None)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_live_page_shows_the_swarm(stack, artifacts):
    def ready() -> bool:
        status = stack.status() or {"stages": []}  # None while the coordinator does not answer
        return all(stage["online"] for stage in status["stages"]) and loss_points(status) >= 2

    stack.wait_for(ready, HISTORY_TIMEOUT, "an ONLINE server in every stage and two loss points in /status's history")

    assert CHROMIUM, "no system chromium: run `make test-stack`, which installs it"
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []  # script errors and CSP refusals show here
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))

            # Every /status document the page receives, in order: the n-th one rendered is served[n - 1].
            served: list[dict] = []

            def record(route):
                reply = route.fetch()
                served.append(reply.json())
                route.fulfill(response=reply)

            page.route("**/status", record)
            page.goto(stack.url + "/")
            # A function, not an expression: the page's Content-Security-Policy forbids eval().
            page.wait_for_function("() => Number(document.getElementById('loss-chart').dataset.points) >= 2",
                                   timeout=PAGE_TIMEOUT_MS)
            shown = page.evaluate(SNAPSHOT)
            page.screenshot(path=str(artifacts / "web-page.png"), full_page=True)
            status = served[shown["rendered"] - 1]

            assert shown["lossPoints"] == loss_points(status) >= 2
            assert shown["lossCanvas"] > 0, "the loss chart has no canvas"
            assert [s["stage"] for s in shown["stages"]] == [s["stage"] for s in status["stages"]]
            for card, stage in zip(shown["stages"], status["stages"]):
                assert stage["servers"], f"stage {stage['stage']} has no servers: nothing to check"
                assert [peer for peer, _ in card["servers"]] == [s["peer_id"] for s in stage["servers"]]
                for (_, text), server in zip(card["servers"], stage["servers"]):
                    assert server["peer_id"][-8:] in text and server["state"] in text, text
                is_bottleneck = stage["stage"] == status["bottleneck_stage"]
                assert card["marked"] == is_bottleneck
                assert card["badge"] == ("bottleneck" if is_bottleneck else None)
            assert status["bottleneck_stage"] is not None
            assert shown["volunteers"] == str(status["volunteers"])
            servers = {s["peer_id"] for stage in status["stages"] for s in stage["servers"] if s["state"] != "OFFLINE"}
            assert status["volunteers"] == len(servers) + status["trainers"]
            assert not errors, errors

            # The coordinator stops answering: the page says so, keeps the last figures, and recovers.
            page.unroute("**/status")
            page.route("**/status", lambda route: route.abort())
            page.wait_for_selector("#notice:not([hidden])", timeout=NOTICE_TIMEOUT_MS)
            assert "unreachable" in page.text_content("#notice")
            assert page.eval_on_selector("#stages", "e => e.children.length") == len(status["stages"])
            page.screenshot(path=str(artifacts / "web-page-unreachable.png"), full_page=True)
            page.unroute("**/status")
            page.wait_for_selector("#notice", state="hidden", timeout=NOTICE_TIMEOUT_MS)
            assert page.evaluate("() => document.body.dataset.reachable") == "true"
        finally:
            browser.close()


MOE_STATUS = {
    "run_id": "moe", "step": 3, "loss": 4.2, "samples_per_second": 10.0, "samples": 480, "trainers": 1,
    "volunteers": 5, "bottleneck_stage": 0, "bottleneck_throughput": 5.0,
    "stages": [{"stage": 0, "servers": [{"peer_id": "QmStage0", "state": "ONLINE", "throughput": 5.0, "step": 3}],
                "online": 1, "throughput": 5.0}],
    "experts": [
        {"expert": 0, "hosts": [{"peer_id": "QmHostAAAAAAAAA", "state": "ONLINE", "throughput": 1.0, "step": 3},
                                {"peer_id": "QmHostBBBBBBBBB", "state": "JOINING", "throughput": 1.0, "step": 0}]},
        {"expert": 1, "hosts": []},
        {"expert": 2, "hosts": [{"peer_id": "<img src=x onerror=alert(1)>", "state": "ONLINE", "throughput": 1.0,
                                 "step": 3}]},
    ],
    "expert_hosts": 2, "unhosted_experts": [1],
    "history": {"time": [], "loss": [], "samples_per_second": []},
}


@pytest.mark.timeout(120)
def test_live_page_lists_each_experts_hosts_and_marks_an_expert_without_one(stack, artifacts):
    """A /status of an MoE run with expert servers (served to the page as is): one row per expert with its
    hosts, the expert without an ONLINE host marked in words, peer ids shown as text; a dense run's page
    has no experts section (the swarm of this module is dense)."""
    import json

    assert CHROMIUM, "no system chromium: run `make test-stack`, which installs it"
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(stack.url + "/")
            page.wait_for_function("() => Number(document.body.dataset.rendered || 0) >= 1", timeout=PAGE_TIMEOUT_MS)
            assert page.evaluate("() => document.getElementById('experts-section').hidden") is True

            page.route("**/status", lambda route: route.fulfill(status=200, content_type="application/json",
                                                                  body=json.dumps(MOE_STATUS)))
            page.wait_for_selector("#experts-section:not([hidden]) tr[data-expert]", timeout=PAGE_TIMEOUT_MS)
            rows = page.evaluate("""() => [...document.querySelectorAll('#experts tr[data-expert]')].map((row) => ({
                expert: row.dataset.expert, unhosted: row.classList.contains('unhosted'), text: row.textContent,
                images: row.querySelectorAll('img').length}))""")
            page.screenshot(path=str(artifacts / "web-page-experts.png"), full_page=True)
            assert [r["expert"] for r in rows] == ["0", "1", "2"]
            assert [r["unhosted"] for r in rows] == [False, True, False]
            assert "AAAAAAAA" in rows[0]["text"] and "BBBBBBBB" in rows[0]["text"]
            assert "none" in rows[1]["text"]
            assert rows[2]["images"] == 0 and "(1)>" in rows[2]["text"]  # a peer id is text, never markup
            assert page.text_content("#volunteers") == "5"
            assert not errors, errors
        finally:
            browser.close()
