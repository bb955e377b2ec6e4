"""docker/grafana/swarm.json: valid by Grafana's own published schema, and every query of it has data.

The schema comes from the npm package @grafana/schema (pinned in tests/stack/grafana/package-lock.json):
tests/stack/grafana/validate.mjs turns its TypeScript types into JSON Schema and checks the dashboard,
each panel, and each panel's plugin options against them. A deliberately broken copy must fail it,
so a validator that accepts anything cannot pass. Then every target's PromQL is asked of a real
Prometheus scraping a real local swarm, and each must return a series with a value.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import shutil
import subprocess
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import wait_until
from tests.procs import REPO_ROOT

GRAFANA = REPO_ROOT / "docker" / "grafana"
DASHBOARD = GRAFANA / "swarm.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "swarm.yaml"
VALIDATOR_DIR = Path(__file__).parent / "grafana"
VALIDATOR = VALIDATOR_DIR / "validate.mjs"
# Where docker/compose.yaml mounts swarm.json in the Grafana container (the provider loads this folder).
DASHBOARDS_IN_CONTAINER = "/var/lib/grafana/dashboards/swarm"

NPM_TIMEOUT = 300.0
VALIDATE_TIMEOUT = 120.0
DATA_TIMEOUT = 90.0  # stack and Prometheus up to every query of the dashboard answered with data
POLL_INTERVAL = 2.0

# Grafana's macros, as the test gives them values. Grafana makes $__rate_interval at least 4 scrape
# intervals (the data source's timeInterval, 5 s as shipped): 20 s is what it is at the shipped 5 s
# scrape interval when zoomed in, and spans 20 scrapes of the test's 1 s one. A dashboard that uses
# another variable or macro must add it here, so its queries are tested with a value.
MACROS = {"$__rate_interval": "20s"}
DATASOURCE_VARIABLE = "${datasource}"

# Everything the dashboard must show, as the metric each needs (issue: loss, samples/s, step per stage,
# servers per stage and state, bottleneck throughput, averaging rounds and their time, request latency
# percentiles, failures and bans, queue depth).
REQUIRED_METRICS = [
    "swarm_loss", "swarm_trainer_loss", "swarm_samples_per_second", "swarm_trainer_samples_total",
    "swarm_stage_step", "swarm_servers", "swarm_bottleneck_throughput_samples_per_second",
    "swarm_averaging_rounds_total", "swarm_averaging_round_seconds_bucket", "swarm_server_request_seconds_bucket",
    "swarm_trainer_call_failures_total", "swarm_trainer_bad_replies_total",
    "swarm_trainer_failed_micro_batches_total", "swarm_trainer_banned_servers", "swarm_server_queue_depth",
]


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' own panels included (rows themselves too)."""
    found = []
    for panel in dashboard.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []) if panel.get("type") == "row" else [])
    return found


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL with the macros given their test values) of every target."""
    found = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for macro, value in MACROS.items():
                expr = expr.replace(macro, value)
            found.append((panel.get("title", "?"), target.get("refId", "?"), expr))
    return found


# --- the schema ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def validator() -> list[str]:
    """The command that validates dashboard files, its npm packages installed (`npm ci`) if they are not."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "node and npm are not installed: run `make test-stack`, which installs them"
    installed = VALIDATOR_DIR / "node_modules" / ".package-lock.json"  # npm writes it after an install
    lock = VALIDATOR_DIR / "package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=VALIDATOR_DIR, capture_output=True,
                              text=True, timeout=NPM_TIMEOUT)
        assert done.returncode == 0, f"npm ci in {VALIDATOR_DIR} failed:\n{done.stdout}{done.stderr}"
    return [node, str(VALIDATOR)]


def run_validator(validator: list[str], *files: Path) -> tuple[int, dict[str, list[str]]]:
    """The validator's exit code and, per file, the lines it printed about it."""
    done = subprocess.run([*validator, *map(str, files)], capture_output=True, text=True, timeout=VALIDATE_TIMEOUT)
    assert done.returncode in (0, 1), f"the validator could not run (exit {done.returncode}):\n" \
                                      f"{done.stdout}{done.stderr}"
    lines: dict[str, list[str]] = {str(f): [] for f in files}
    for line in done.stdout.splitlines():
        file, _, message = line.partition(": ")
        assert file in lines, f"unexpected validator output: {line!r}\n{done.stdout}{done.stderr}"
        lines[file].append(message)
    return done.returncode, lines


def _first(dashboard: dict[str, Any], panel_type: str) -> int:
    return next(i for i, p in enumerate(dashboard["panels"]) if p["type"] == panel_type)


def broken_copies() -> dict[str, tuple[dict[str, Any] | str, str]]:
    """Copies of the dashboard with one fault each: name -> (document, the one error the validator must print)."""
    good = load_dashboard()
    ts, stat = _first(good, "timeseries"), _first(good, "stat")
    broken: dict[str, tuple[dict[str, Any] | str, str]] = {}

    def variant(name: str, error: str, change: Callable[[dict[str, Any]], Any]) -> None:
        doc = copy.deepcopy(good)
        change(doc)
        broken[name] = (doc, error)

    variant("grid-not-object", f"/panels/{ts}/gridPos: must be object",
            lambda d: d["panels"][ts].update(gridPos="x"))
    variant("grid-missing-field", f"/panels/{ts}/gridPos: must have required property 'w'",
            lambda d: d["panels"][ts]["gridPos"].pop("w"))
    variant("no-schema-version", "/: must have required property 'schemaVersion'", lambda d: d.pop("schemaVersion"))
    variant("schema-version-string", "/schemaVersion: must be number", lambda d: d.update(schemaVersion="41"))
    variant("unknown-panel-field", f"/panels/{ts}: must NOT have additional properties: 'gridpos'",
            lambda d: d["panels"][ts].update(gridpos={}))
    variant("unknown-panel-type", f"/panels/{ts}/type: @grafana/schema",
            lambda d: d["panels"][ts].update(type="timeserie"))
    variant("bad-legend-placement", f"/panels/{ts}/options/legend/placement: must be equal to one of the allowed",
            lambda d: d["panels"][ts]["options"]["legend"].update(placement="middle"))
    variant("stat-missing-option", f"/panels/{stat}/options: must have required property 'reduceOptions'",
            lambda d: d["panels"][stat]["options"].pop("reduceOptions"))
    variant("bad-draw-style", f"/panels/{ts}/fieldConfig/defaults/custom/drawStyle: must be equal to one of",
            lambda d: d["panels"][ts]["fieldConfig"]["defaults"]["custom"].update(drawStyle="curve"))
    variant("variable-without-name", "/templating/list/0: must have required property 'name'",
            lambda d: d["templating"]["list"][0].pop("name"))
    broken["not-json"] = ('{"schemaVersion": 41,', "JSON")
    return broken


@pytest.fixture(scope="session")
def validation(validator, tmp_path_factory: pytest.TempPathFactory):
    """One run of the validator (it builds the schema each time, some seconds) over the dashboard and
    the broken copies: (exit code, lines per file, {broken file: (name, the error expected)})."""
    folder = tmp_path_factory.mktemp("broken-dashboards")
    expected = {}
    for name, (doc, error) in broken_copies().items():
        path = folder / f"{name}.json"
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        expected[str(path)] = (name, error)
    code, lines = run_validator(validator, DASHBOARD, *expected)
    return code, lines, expected


def test_dashboard_is_valid_by_grafanas_published_schema(validation):
    _, lines, _ = validation
    printed = lines[str(DASHBOARD)]
    assert len(printed) == 1 and printed[0].startswith("ok"), \
        "docker/grafana/swarm.json does not match @grafana/schema:\n" + "\n".join(printed)


def test_validator_rejects_broken_dashboards(validation):
    """Each copy with one fault fails, with that fault named exactly, and only it."""
    code, lines, expected = validation
    assert code == 1, lines
    for path, (name, error) in expected.items():
        printed = lines[path]
        assert len(printed) == 1 and error in printed[0], f"{name}: expected one error with {error!r}, got {printed}"


# --- the dashboard's own rules, and its provisioning --------------------------------------------------------


def test_panels_have_unique_ids_and_do_not_overlap():
    dashboard = load_dashboard()
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, f"{p['title']!r} is outside the 24 columns: {grid}"
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r} at {(x, y)}"
                cells[(x, y)] = p["title"]


def test_every_panel_queries_the_provisioned_prometheus():
    dashboard = load_dashboard()
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    assert source["current"]["value"] == uid, "the data source variable must default to the provisioned uid"
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            continue
        title = panel["title"]
        assert panel["targets"], f"{title!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"{title!r} repeats a refId: {refs}"
        for target in [panel, *panel["targets"]]:
            assert target["datasource"] == {"type": "prometheus", "uid": DATASOURCE_VARIABLE}, title
    for title, ref, expr in queries(dashboard):
        assert "$" not in expr, f"{title!r} {ref}: a variable or macro the test gives no value (MACROS): {expr}"


def test_dashboard_shows_everything_the_issue_lists():
    exprs = [expr for _, _, expr in queries(load_dashboard())]
    missing = [m for m in REQUIRED_METRICS if not any(re.search(rf"\b{m}\b", e) for e in exprs)]
    assert not missing, f"no panel queries {missing}"
    latency = [e for e in exprs if "swarm_server_request_seconds_bucket" in e]
    for quantile in ("0.5", "0.9", "0.99"):
        assert any(e.startswith(f"histogram_quantile({quantile},") for e in latency), f"no p{quantile} latency"


def test_provisioning_points_grafana_at_prometheus_and_the_dashboard():
    datasource = yaml.safe_load(DATASOURCES.read_text())
    assert datasource["apiVersion"] == 1
    [source] = datasource["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://127.0.0.1:9090"
    shipped = yaml.safe_load((REPO_ROOT / "docker" / "prometheus.yml").read_text())
    assert source["jsonData"]["timeInterval"] == shipped["global"]["scrape_interval"], \
        "the data source's timeInterval must be Prometheus' scrape interval ($__rate_interval is built on it)"
    providers = yaml.safe_load(PROVIDERS.read_text())
    assert providers["apiVersion"] == 1
    [provider] = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == DASHBOARDS_IN_CONTAINER


# --- every query has data ---------------------------------------------------------------------------------


def has_data(result: list[dict[str, Any]]) -> bool:
    """A series with a value that is a number (0 counts; NaN, e.g. histogram_quantile of no events, does not)."""
    return any(not math.isnan(float(series["value"][1])) for series in result if "value" in series)


@pytest.mark.timeout(400)
def test_every_panel_query_returns_data(stack, prometheus):
    """Polled together until each has had data once: some series appear only after activity (averaging
    rounds, failures) and a rate needs two scrapes."""
    pending = {(title, ref): expr for title, ref, expr in queries(load_dashboard())}
    last: dict[tuple[str, str], str] = {}

    def all_answered() -> bool:
        for key, expr in list(pending.items()):
            try:
                result = prometheus.query(expr)
            except Exception as e:  # a query Prometheus refuses: report it (and why) with the others
                why = e.read().decode(errors="replace") if isinstance(e, urllib.error.HTTPError) else ""
                last[key] = f"error: {e} {why}"
                continue
            if has_data(result):
                del pending[key]
            else:
                last[key] = f"only NaN: {result}" if result else "no series"
        return not pending

    with contextlib.suppress(AssertionError):  # what is still pending is reported below, query by query
        wait_until(all_answered, DATA_TIMEOUT, POLL_INTERVAL, "every panel's query to return data")
    report = "\n".join(f"  panel {title!r} query {ref}: {last[(title, ref)]}\n    {expr}"
                       for (title, ref), expr in pending.items())
    assert not pending, f"{len(pending)} queries returned no data within {DATA_TIMEOUT:.0f} s:\n{report}"
