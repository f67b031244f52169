# The two commands of the README. Both install what is missing, idempotently:
# Debian's zookeeper and a JRE, a venv with the pinned packages (requirements.txt),
# and the Cython extensions built in place.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: run test setup system-deps venv build clean

run: setup
	$(VENV)/bin/bk sandbox --dir sandbox

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

setup: system-deps venv build

system-deps:
	@if ! dpkg -s zookeeper >/dev/null 2>&1 || ! command -v java >/dev/null 2>&1; then \
		echo "installing zookeeper and a JRE (apt)"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq zookeeper default-jre-headless >/dev/null; \
	fi

$(VENV)/.stamp-deps: requirements.txt
	@command -v python3 >/dev/null || { echo "python3 is required"; exit 1; }
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

venv: $(VENV)/.stamp-deps

build: venv
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) setup.py -q build_ext --inplace

clean:
	rm -rf build bookkeeper/_ext/*.so ext/bookkeeper/_ext/*.c *.egg-info
