# The two commands of the README: `make demo` and `make test`. Both create .venv (the venv
# location is part of the interface) and install the pinned dependencies once: the stamp file
# is rebuilt only when requirements.txt or pyproject.toml change.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.grcompile-installed
PYTEST_ARGS ?=

.PHONY: install demo test test-slow bench clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps torchrec==1.8.0
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $@

demo: install
	$(PY) -m grcompile.demo

test: install
	$(PY) -m pytest -q -n 2 $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

bench: install
	$(PY) -m grcompile.bench --model hstu --preset small --max-len 1024 --batch-size 32 \
		--modes eager,inductor,grcompile --json docs/bench/hstu-small-1024.json --plot docs/bench/hstu-small-1024.png

clean:
	rm -rf $(VENV) .hypothesis .pytest_cache
