# Two commands set everything up on a fresh Linux machine (Python >= 3.10):
#   make run    install into .venv, then train the default T6 on the embedded corpus
#   make test   install with test dependencies into .venv, then run the test suite
# torch is installed first and pinned (a CPU build where the machine provides one); every
# other package is pinned in constraints.txt so a fresh machine resolves the same stack.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ARGS ?=

.PHONY: run test install install-test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) install --disable-pip-version-check -q torch==2.13.0
	$(PIP) install --disable-pip-version-check -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install --disable-pip-version-check -q -c constraints.txt -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(PY) train.py $(ARGS)

test: install-test
	$(PY) -m pytest $(ARGS)

clean:
	rm -rf $(VENV) logs mlruns data
