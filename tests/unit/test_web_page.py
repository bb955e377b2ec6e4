"""The coordinator's live page: its files as served, the history its charts draw, and the status fields it shows."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from html.parser import HTMLParser

import pytest
from prometheus_client import CollectorRegistry

from coordinator.status import build_status
from coordinator.web import FILES, StatusHistory, page_routes
from swarm.dht import PeerMetricsRecord, ServerRecord
from swarm.metrics import MetricsServer, Reply, Request


def get(routes: dict, path: str) -> Reply:
    return routes[path](Request(path, "", "127.0.0.1"))


class Links(HTMLParser):
    """Every src and href in a page, and the page's Content-Security-Policy."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.csp: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.urls += [attrs[name] for name in ("src", "href") if attrs.get(name) is not None]
        if tag == "meta" and (attrs.get("http-equiv") or "").lower() == "content-security-policy":
            self.csp = attrs["content"]


def page_links() -> Links:
    links = Links()
    links.feed(get(page_routes(), "/").body.decode())
    return links


def test_page_and_files_are_served_with_their_types_and_caching():
    routes = page_routes()
    expected = {
        "/": ("text/html", "no-cache"),
        "/app.js": ("text/javascript", "max-age="),
        "/style.css": ("text/css", "max-age="),
        "/vendor/uPlot.iife.min.js": ("text/javascript", "max-age="),
        "/vendor/uPlot.min.css": ("text/css", "max-age="),
    }
    assert set(routes) == set(expected)
    for path, (content_type, cache) in expected.items():
        reply = get(routes, path)
        assert reply.code == 200, path
        assert reply.content_type.startswith(content_type) and "charset=utf-8" in reply.content_type, path
        assert cache in reply.cache, path
        assert len(reply.body) > 100, path


def test_page_loads_only_its_own_files():
    """No CDN, no fonts, nothing absolute: every link is a relative path this coordinator serves."""
    links = page_links()
    assert links.urls, "the page links nothing?"
    for url in links.urls:
        if url.startswith("data:"):  # the empty favicon, so that the browser asks for none
            continue
        assert not re.match(r"^([a-z][a-z0-9+.-]*:|//|/)", url, re.I), f"{url!r} is not a relative path"
        assert "/" + url in FILES, f"{url!r} is not served"
    for path in FILES:
        text = get(page_routes(), path).body.decode()
        assert "@import" not in text and "url(http" not in text, path
        if not path.startswith("/vendor/"):  # uPlot names its home page in its licence comment, nothing more
            assert not re.search(r"https?://", text), f"{path} names an absolute URL"
    # The browser holds the page to it as well.
    assert "default-src 'none'" in links.csp and "connect-src 'self'" in links.csp
    assert "script-src 'self'" in links.csp and "unsafe" not in links.csp


def test_page_never_parses_status_strings_as_html():
    script = get(page_routes(), "/app.js").body.decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink


def test_vendored_chart_library_is_uplot_with_its_licence():
    from importlib import resources

    vendor = resources.files("coordinator.web").joinpath("vendor")
    assert "(v1.6.32)" in vendor.joinpath("uPlot.iife.min.js").read_text()[:100]
    assert "MIT License" in vendor.joinpath("uPlot.LICENSE").read_text()


def test_metrics_server_serves_the_page_and_404s_the_rest():
    server = MetricsServer(CollectorRegistry(), 0, host="127.0.0.1", routes=page_routes())
    try:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(base + "/", timeout=10) as reply:
            assert reply.status == 200
            assert reply.headers["Content-Type"] == "text/html; charset=utf-8"
            assert reply.headers["Cache-Control"] == "no-cache"
            assert b"<title>swarm</title>" in reply.read()
        with urllib.request.urlopen(base + "/app.js?v=1", timeout=10) as reply:  # a query changes nothing
            assert reply.status == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/index.html.bak", timeout=10)
        assert err.value.code == 404
    finally:
        server.close()


def status(step: int, loss: float | None, sps: float) -> dict:
    return {"step": step, "loss": loss, "samples_per_second": sps}


def test_history_keeps_points_spacing_seconds_apart():
    history = StatusHistory(capacity=10, spacing=5.0)
    assert history.columns() == {"time": [], "step": [], "loss": [], "samples_per_second": []}
    assert history.record(status(1, None, 0.0), now=100.0)
    assert not history.record(status(2, 3.0, 1.0), now=102.0)  # too soon
    assert history.record(status(3, 2.123456789, 4.56789), now=106.0)
    assert history.columns() == {
        "time": [100.0, 106.0],
        "step": [1, 3],
        "loss": [None, 2.1235],  # no loss reported yet: a gap in the chart, not a zero
        "samples_per_second": [0.0, 4.57],
    }


def test_history_is_bounded_and_thinned_to_span_the_whole_run():
    history = StatusHistory(capacity=8, spacing=1.0)
    for t in range(1000):
        history.record(status(t, 1.0 / (t + 1), float(t)), now=float(t))
        assert len(history) <= 8
    times = history.columns()["time"]
    assert times[0] == 0.0, "the run's first point is kept"
    assert times[-1] >= 1000 - history.spacing, "and the latest"
    assert history.spacing == 128.0  # doubled at each thinning: 1 -> 2 -> ... -> 128
    gaps = {b - a for a, b in zip(times, times[1:])}
    assert gaps == {history.spacing}, "points are evenly spread"


def test_history_drops_non_finite_losses():
    history = StatusHistory(spacing=1.0)
    history.record(status(1, float("nan"), 1.0), now=0.0)
    history.record(status(2, float("inf"), 1.0), now=1.0)
    assert history.columns()["loss"] == [None, None]
    json.loads(json.dumps(history.columns()), parse_constant=pytest.fail)  # valid JSON for the browser


def test_history_rejects_a_useless_shape():
    with pytest.raises(ValueError):
        StatusHistory(capacity=1)
    with pytest.raises(ValueError):
        StatusHistory(spacing=0.0)


def server(peer: str, stage: int, state: str = "ONLINE", throughput: float = 1.0) -> ServerRecord:
    return ServerRecord(peer_id=peer, stage=stage, state=state, throughput=throughput)


def trainer(peer: str, loss: float | None = 2.0) -> PeerMetricsRecord:
    return PeerMetricsRecord(peer_id=peer, role="trainer", step=0, samples_per_second=1.0, samples=10,
                             time=0.0, loss=loss)


def test_status_names_the_bottleneck_stage_and_counts_volunteers():
    servers = {
        0: [server("a", 0, throughput=5.0), server("b", 0, throughput=4.0)],
        1: [server("c", 1, throughput=3.0), server("d", 1, "JOINING", 100.0), server("e", 1, "OFFLINE", 100.0)],
        2: [server("f", 2, throughput=9.0)],
    }
    metrics = [trainer("t1"), trainer("t2", None),
               PeerMetricsRecord(peer_id="a", role="server", step=0, samples_per_second=1.0, samples=1, time=0.0)]
    doc = build_status("run", servers, metrics)
    assert doc["bottleneck_stage"] == 1  # only ONLINE servers count: 3 samples/s
    assert doc["bottleneck_throughput"] == 3.0
    # a b c d f serve (e has left), t1 t2 train; a's own metrics report is the same volunteer
    assert doc["volunteers"] == 7
    json.dumps(doc)


def test_status_counts_a_strangers_huge_claim_capped_and_gives_each_stages_share():
    # one stranger announcing a million samples/s on stage 0 weighs as one server 4 x the lower median claim
    # (10): 40, so stage 0 (42) stays the bottleneck against stage 1's five servers (50); counted as claimed,
    # stage 0 would look 20,000 times faster than stage 1
    servers = {0: [server("a", 0, throughput=2.0), server("liar", 0, throughput=1e6)],
               1: [server(p, 1, throughput=10.0) for p in "bcdef"]}
    doc = build_status("run", servers, [])
    assert [s["throughput"] for s in doc["stages"]] == [42.0, 50.0]
    assert (doc["bottleneck_stage"], doc["bottleneck_throughput"]) == (0, 42.0)
    assert [round(s["share"], 4) for s in doc["stages"]] == [round(42 / 92, 4), round(50 / 92, 4)]
    assert build_status("run", {0: [], 1: []}, [])["stages"][0]["share"] == 0.0


def test_status_bottleneck_ties_go_to_the_lower_stage_and_empty_swarms_have_none():
    doc = build_status("run", {0: [], 1: [], 2: []}, [])
    assert doc["bottleneck_stage"] == 0 and doc["volunteers"] == 0
    doc = build_status("run", {0: [server("a", 0, throughput=2.0)], 1: [server("b", 1, throughput=1.0)],
                               2: [server("c", 2, throughput=1.0)]}, [])
    assert doc["bottleneck_stage"] == 1
    doc = build_status("run", {}, [])
    assert doc["bottleneck_stage"] is None and doc["volunteers"] == 0
