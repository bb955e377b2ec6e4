# Two commands on a fresh clone: `make demo` (a local swarm training, visibly) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-swarms test-repeat test-stack test-image test-net lint reference bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/swarm-local --config configs/tiny.yaml --steps 100 --summary demo-summary.json

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not swarms" -n 2 --dist loadfile tests/unit tests/integration

# Whole swarms of separate programs that run for a minute each (resuming a dead stage and a whole
# swarm from checkpoints; MoE swarms losing an expert server; routing around slow, killed and missing
# servers), kept out of `make test` for its time.
test-swarms: $(STAMP)
	$(PY) -m pytest -q -m swarms tests/integration

# The integration tests of `make test` and the routing-fault swarms ten times in a row, every run's output
# kept (not in CI: it is how a flaky test is found; about 75 minutes here).
test-repeat: $(STAMP)
	tests/repeat_integration.sh 10

# Slower suites with real outside programs (installed by docker/install-test-tools.sh, as root):
# a real Prometheus, promtool, Grafana's dashboard schema and a headless Chromium against a local swarm...
test-stack: $(STAMP)
	docker/install-test-tools.sh
	npm --prefix tests/stack/grafana ci --no-audit --no-fund --silent
	$(PY) -m pytest -q tests/stack

# ...and the volunteer image, built with podman, joining a swarm on this machine.
test-image: $(STAMP)
	docker/install-test-tools.sh
	docker/test-image.sh

# Swarms across a lab of network namespaces (tests/netlab: latency, rate limits, home-router NAT), as root.
# tests/netlab/install.sh installs iptables and the delayer's NetfilterQueue.
test-net: $(STAMP)
	tests/netlab/install.sh
	$(PY) -m pytest -q tests/net

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
