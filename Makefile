# Capsule — the two commands: `make demo` and `make test`. Both set up the
# host first (Debian packages, libvirt, the virtualenv); a second run skips
# what is already done.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CAPSULE := $(VENV)/bin/capsule
PYTEST_ARGS ?=

.PHONY: demo demo-compose test check fuzz setup host venv native web lint bench bench-quick bench-live clean-venv agent compose-up compose-down compose-build

demo: setup
	$(PY) scripts/demo.py

# The same story between the compose hosts (separate root file systems, stores, libvirtds; see docs/hosts.md
# for why it is not `make demo` itself). Brings them up first (`make compose-up`) and leaves them running.
demo-compose: setup
	$(PY) scripts/demo_compose.py

# The suite: the unit and tools tiers run alongside the guest tiers (scripts/suite.py); PYTEST_ARGS that
# select tests (paths, -m, -k) run as one pytest instead.
test: setup
	$(MAKE) --no-print-directory lint
	$(PY) scripts/suite.py $(PYTEST_ARGS)

# The fast loop while working: lint (code, types, the generated reference chapters, the manual) and the unit
# tier on every core (pytest-xdist); under 2 minutes.
check: venv native
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest -q -m unit -p no:cacheprovider -n auto tests/unit

# The fuzzers for longer than `make test` runs them: every Hypothesis fuzz test (tests/unit/test_fuzz_*.py)
# with the `fuzz` profile (20,000 examples each instead of 200), then the guest agent's request parser
# under libFuzzer with AddressSanitizer and UBSan for FUZZ_TIME seconds (guest-balloon/fuzz/).
FUZZ_TIME ?= 60
fuzz: setup
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -p no:cacheprovider tests/unit/test_fuzz_*.py $(PYTEST_ARGS)
	$(MAKE) -C guest-balloon fuzz FUZZ_TIME=$(FUZZ_TIME)

setup: host venv native web

host:
	@bash scripts/setup-host.sh

# The virtualenv uses Debian's python3 (nbdkit's Python plugin embeds it: same ABI).
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || /usr/bin/python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

# The compiled hot paths (native/: Rust, PyO3 + maturin, built by cargo — found on PATH or in
# ~/.cargo/bin), installed into the virtualenv as the separate distribution capsule-native, and the disk
# server's native read path (below). Rebuilt only when the crate changes; cargo keeps its build
# directory, so a rebuild compiles only what changed.
native: $(VENV)/.native diskserver/fastread/capsule-fastread.so

$(VENV)/.native: $(VENV)/.installed scripts/build-native.sh native/Cargo.toml native/Cargo.lock native/pyproject.toml $(wildcard native/src/*.rs)
	@bash scripts/build-native.sh $(PY)
	@touch $@

# The disk server's native read path: an nbdkit filter in C (nbdkit-plugin-dev, installed by `make host`).
diskserver/fastread/capsule-fastread.so: diskserver/fastread/fastread.c diskserver/fastread/Makefile
	$(MAKE) -s -C diskserver/fastread

# The page's browser libraries (noVNC), exactly as web/package-lock.json pins them; served by the agent.
web: web/node_modules/.package-lock.json

web/node_modules/.package-lock.json: web/package.json web/package-lock.json
	cd web && npm ci --no-audit --no-fund

# The guest agent (static C binary guest-balloon/capsule-agent). Image builds run this themselves
# when the binary is missing or older than any of its sources, so nothing above depends on it.
agent:
	$(MAKE) -C guest-balloon

# The issue's speed ratios in one table, a few minutes, no guest (bench/quick.py → bench/results/quick.json)
bench-quick: setup
	$(PY) bench/quick.py

# ruff; types (mypy on all the code but tests/, which is not type-checked: function bodies checked even
# without annotations, hashcache/ and diskserver/ strict; pyproject.toml); the CLI reference and exit
# codes in docs/ must match the code (scripts/gen_reference.py writes them); the manual builds in strict
# mode (a broken link, a missing anchor or an orphan page fails).
lint: venv
	$(PY) -m ruff check capsule hashcache diskserver pods tests testkit bench scripts
	$(VENV)/bin/mypy hashcache diskserver capsule pods testkit scripts bench
	$(PY) scripts/gen_reference.py --check
	$(VENV)/bin/mkdocs build --quiet

bench: setup
	$(PY) bench/hashcache_micro.py
	$(PY) bench/suspend_resume.py
	$(PY) bench/hcp_bench.py
	$(PY) bench/balloon_bench.py
	$(PY) bench/diskserver_micro.py
	$(PY) bench/demand_bench.py --rate-kbit 100000 --rtt-ms 1
	$(PY) bench/dashboard_migrate.py
	$(PY) bench/console_latency.py
	$(PY) bench/desktop_boot.py
	$(PY) bench/pods_bench.py
	$(PY) bench/backup_series.py
	$(PY) bench/update_bytes.py

# B2 live between the compose hosts (own compose project capsule-b2; needs root: tc on lo)
bench-live: setup
	$(PY) -m bench.livemigrate

# Separate Capsule hosts in containers (docker-compose.yml): each its own root file system,
# store, libvirtd and agent on a loopback port. The `hosts` test tier runs against them.
COMPOSE := PATH=/usr/bin:/usr/sbin:$$PATH COMPOSE_PROJECT_NAME=capsule docker-compose

compose-up: host native web
	@bash compose/up.sh

compose-down:
	$(COMPOSE) down

clean-venv:
	rm -rf $(VENV)
