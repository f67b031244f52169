# The two commands of the README. Both install what is missing, idempotently:
# Debian's zookeeper, a JRE and supervisor, a venv with the exact versions of
# requirements.txt, and the package itself (editable), whose Cython extensions are
# built once here and again only when their sources change.
#   make test PYTHON=python3.13     the same on another interpreter, in .venv-python3.13
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
# The interpreter's real path; a pyenv shim for a version that is installed but not
# selected (python3.13 here) is resolved through pyenv.
PYTHON_EXE := $(shell p=$(PYTHON); if $$p -c '' 2>/dev/null; then $$p -c 'import sys; print(sys.executable)'; \
	elif command -v pyenv >/dev/null; then v=$$(pyenv versions --bare | grep -x "$${p:6}[.0-9]*" | tail -1); \
	[ -n "$$v" ] && PYENV_VERSION=$$v pyenv which $$p; fi)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
# Test processes (pytest-xdist, whole modules per worker: a module's cluster stays in one
# process). Most tests wait on real processes, timers and disks: with two workers on two
# cores ~0.3 of a core stayed idle, mostly while the Ansible deployment (the longest module)
# ran beside modules that wait; a third worker fills that. Modules are handed out in
# collection order, which tests/conftest.py makes longest first (the `runtime` marker).
TEST_WORKERS ?= 3
EXT_SOURCES := $(wildcard ext/bookkeeper/_ext/*.pyx ext/bookkeeper/_ext/*.pxd)
LOADTEST_ARGS ?= -u 12 -r 12 -t 30s
LOADTEST_DIR := loadtest-out
# Debian's packages the tests run for real: ZooKeeper, supervisord (the Ansible role's
# private supervisor), and for the multi-host tests (network namespaces as hosts) sshd,
# nftables (partitions) and iproute2.
APT_PACKAGES := zookeeper supervisor openssh-server nftables iproute2
VERIFY_SECONDS ?= 180
SIM_SEEDS ?= 0..199
SIM_OPS ?= 5000

.PHONY: run test loadtest setup system-deps venv build clean fuzz verify sim

run: setup
	$(VENV)/bin/bk sandbox --dir sandbox

# The multi-host module (eight hosts, a ZooKeeper quorum, Ansible over SSH) is CPU-bound on
# two cores: beside two other workers it took ~10 min, alone ~5. So a plain `make test` runs
# it first, alone, then the rest; with PYTEST_ARGS, one run of what they select.
MULTIHOST := tests/test_multihost.py
test: setup
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PY) -m pytest $(MULTIHOST)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --ignore=$(MULTIHOST)
else
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
endif

setup: system-deps venv build

system-deps:
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || ! command -v java >/dev/null 2>&1; then \
		echo "installing $(APT_PACKAGES) and a JRE (apt)"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
			$(APT_PACKAGES) default-jre-headless >/dev/null; \
	fi

$(VENV)/.stamp-deps: requirements.txt
	@[ -n "$(PYTHON_EXE)" ] || { echo "$(PYTHON) is required"; exit 1; }
	$(PYTHON_EXE) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

venv: $(VENV)/.stamp-deps

$(VENV)/.stamp-build: $(VENV)/.stamp-deps pyproject.toml setup.py $(EXT_SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.stamp-build

# `make verify VERIFY_SECONDS=N` (default 180): `bk verify` against a local cluster of 5 bookies
# with every local fault kind on a seeded schedule; exits non-zero on any anomaly (docs/operations.md).
verify: setup
	$(VENV)/bin/bk verify local --bookies 5 --seconds $(VERIFY_SECONDS) --dir verify-out

# `make sim SIM_SEEDS=A..B SIM_OPS=M` (default 0..199, 5000): the deterministic simulator over many
# seeds (docs/simulation.md); stops at the first violated invariant, with the command to replay it.
sim: setup
	$(VENV)/bin/bk sim --seeds $(SIM_SEEDS) --ops $(SIM_OPS)

# A sandbox in the background, a headless locust run against it, the sandbox stopped.
loadtest: setup
	@mkdir -p $(LOADTEST_DIR)
	@$(VENV)/bin/bk sandbox --dir $(LOADTEST_DIR)/sandbox > $(LOADTEST_DIR)/sandbox.log 2>&1 & pid=$$!; \
	trap 'kill -INT $$pid 2>/dev/null; wait $$pid' EXIT; \
	for _ in $$(seq 120); do grep -q '^metadata_uri=' $(LOADTEST_DIR)/sandbox.log && break; \
		kill -0 $$pid 2>/dev/null || { cat $(LOADTEST_DIR)/sandbox.log; exit 1; }; sleep 1; done; \
	uri=$$(sed -n 's/^metadata_uri=//p' $(LOADTEST_DIR)/sandbox.log); \
	$(VENV)/bin/locust -f loadtest/locustfile.py --headless $(LOADTEST_ARGS) --metadata-uri $$uri \
		--csv $(LOADTEST_DIR)/run --json-file $(LOADTEST_DIR)/run --only-summary; \
	echo "results: $(LOADTEST_DIR)/run_stats.csv, $(LOADTEST_DIR)/run_hdr.csv"

# `make fuzz FUZZ_SECONDS=N` (default 60): every target of tests/fuzz for N seconds, on the Cython
# modules built again with clang's ASan, UBSan and coverage into build/fuzz (the normal build is
# untouched); new crashes are saved into tests/fuzz/corpus/<target>/ (tests/fuzz/README.md).
fuzz: setup
	@dpkg -s clang-14 libclang-rt-14-dev >/dev/null 2>&1 || { echo "installing clang-14 (apt)"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
			clang-14 libclang-rt-14-dev >/dev/null; }
	CC=clang-14 LDSHARED="clang-14 -shared" LDFLAGS="-fsanitize=address,undefined" \
		CFLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g" \
		$(PY) setup.py -q build_ext --build-lib build/fuzz --build-temp build/fuzz-tmp
	$(PY) tests/fuzz/run.py --all --seconds $(or $(FUZZ_SECONDS),60) --sanitized build/fuzz

clean:
	rm -rf build bookkeeper/_ext/*.so ext/bookkeeper/_ext/*.c *.egg-info .venv*/.stamp-build
