# Two commands set everything up on a fresh Linux machine (Python >= 3.10):
#   make run    install into .venv (and build the fused CPU decode kernels), then train the default T6 on the embedded corpus
#   make test   install with test dependencies into .venv (and, as root, Debian's chromium and
#               chromium-driver for the MLflow UI browser test), lint (ruff), then run the test suite
# torch is installed first and pinned (a CPU build where the machine provides one); every
# other package is pinned in constraints.txt so a fresh machine resolves the same stack, and installed by uv
# (~25 s where pip takes ~100 s on 2 cores), or by pip where uv cannot reach the index pip is configured with.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# uv reads neither pip's config nor its find-links, so torch (a local CPU build on some machines) comes from pip;
# bytecode is compiled at install, as pip does, or every process compiles the libraries it imports.
UV_INSTALL := $(VENV)/bin/uv pip install --python $(PY) --compile-bytecode -q
ARGS ?=

.PHONY: run test install install-test browser clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) install --disable-pip-version-check -q torch==2.13.0 uv==0.13.9
	$(UV_INSTALL) -c constraints.txt -e . || $(PIP) install --disable-pip-version-check -q -c constraints.txt -e .
	$(PY) -c 'from t6.model.attention.fused_decode import cpu_extension as build; \
		print("fused CPU decode kernels:", "built" if build() else "not built, decoding runs eager")'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(UV_INSTALL) -c constraints.txt -e '.[test]' || $(PIP) install --disable-pip-version-check -q -c constraints.txt -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(PY) train.py $(ARGS)

# The MLflow UI test drives headless Chromium: installed from Debian's packages when missing and we
# are root; otherwise this says what to install (under CI=true the test then fails instead of skipping).
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 chromium chromium-driver; \
	else \
		echo "MLflow UI test: install Chromium and its driver, e.g. sudo apt-get install chromium chromium-driver"; \
	fi

# The tests run on every core (pytest-xdist, at most 4 workers: each holds a few GiB); TEST_WORKERS=0 runs them in one
# process. Tests go out one at a time, longest first (tests/conftest.py): xdist's default hands each worker a quarter of
# the suite up front, in order, which gave one worker every slow test.
TEST_WORKERS ?= auto
test: install-test browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --maxschedchunk 1 $(ARGS)

clean:
	rm -rf $(VENV) logs mlruns data
