# Newcomer entry points. `make demo` and `make test` each set up everything they need.
VENV ?= .venv
PY := $(VENV)/bin/python
FLOWEDGE := $(VENV)/bin/flowedge
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup browser arm-cross demo test test-fast bench wheel clean

setup: $(VENV)/.installed

# torch is pinned to the CPU build first so that pip never resolves a CUDA build for a bare `torch`.
$(VENV)/.installed: setup.cfg setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# Chromium for the dashboard's browser test (tests/test_api_dashboard.py skips it, saying why, without one).
# playwright (the test extra) drives this chromium by its path: no `playwright install` download
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium; }; }; } || \
		echo "no chromium (not root or no apt-get): the dashboard's browser test will be skipped"

# An aarch64 cross compiler and qemu for the NEON kernel test (tests/test_kernels_neon.py skips it, saying why,
# without them)
arm-cross:
	@{ command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64; } >/dev/null 2>&1 || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -q gcc-aarch64-linux-gnu qemu-user >/dev/null 2>&1 || \
		{ apt-get update -q && apt-get install -y -q gcc-aarch64-linux-gnu qemu-user; }; }; } || \
		echo "no aarch64 cross compiler or qemu (not root or no apt-get): the NEON kernel test will be skipped"

demo: setup
	$(FLOWEDGE) up --nodes 3 --prompt "$(PROMPT)"

# The suite in two passes: most tests, then the `serial` ones alone, as their timing assertions expect a box of
# their own. TEST_WORKERS=2 runs the first pass on two pytest-xdist workers (a file per worker at a time,
# tests/conftest.py): 27 min instead of 36 on a 2-vCPU Xeon, but in one of two such runs two tests with
# deadlines (the dashboard's streaming page, the drafter's job cache) missed them beside the real pair's
# cluster, so the default stays one process (0: no workers) until they hold under that load.
TEST_WORKERS ?= 0
test: setup browser arm-cross
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup -m "not serial" --durations=20; \
		parallel=$$?; \
	$(PY) -m pytest -q -p no:cacheprovider -m serial --durations=10; \
		serial=$$?; [ $$parallel = 0 ] && [ $$serial = 0 ]

test-fast: setup browser arm-cross
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup -m "not real_model"

bench: setup
	$(FLOWEDGE) bench --dataset mt-bench --dataset humaneval --samples 10 --max-new-tokens 128 \
		--nodes 5 --profile orin-nano-8gb --verify oracle --out bench-out

# dist/flowedge-VERSION-py3-none-any.whl, to install anywhere with the extras a machine needs (README:
# Installing). Any Python 3.11+ with pip builds it; pip fetches setuptools for the build.
wheel:
	rm -rf build dist/flowedge-*.whl
	python3 -m pip wheel --no-deps -q -w dist .
	@echo "built $$(ls dist/flowedge-*.whl): pip install '$$(ls dist/flowedge-*.whl)[node]' (a head or a stage), without [node] for a client"

clean:
	rm -rf $(VENV) bench-out build dist
