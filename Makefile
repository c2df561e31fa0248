# The project's entry points. `make run` and `make test` are the README's two commands.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# two install stamps: what the demo needs (`make run`), and everything (`make test`)
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian packages. The demo's: gcc and python3-dev, since setup.py compiles shm://'s and tcp://'s
# fast paths and the gateway's combine (transport/_shmfast.c, transport/_tcpfast.c, gateway/_combine.c).
RUN_APT_PKGS := gcc python3-dev
# The rest, for `make test`: pyverbs/rdma-core (not on PyPI), libibverbs-dev for rdma://'s
# fast path (transport/_rdmafast.c needs verbs.h), and the real services the ops tests run
TEST_APT_PKGS := python3-pyverbs rdma-core ibverbs-providers libibverbs-dev iproute2 docker-compose prometheus
BACKEND ?= shm
TORCH_VERSION ?= 2.13.0
OUT := build

.PHONY: deps native native-run run test test-host test-rdma docs bench bench-micro bench-rdma bench-rdma-two-hosts bench-moe bench-chunks bench-load bench-ray compose-check k8s-check secret clean

# installs the Debian packages of $(1) that are missing
define apt_install
	@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then echo "apt: installing $$missing"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $$missing; fi
endef

# the demo's needs only: the package without extras (numpy, msgpack, threadpoolctl,
# prometheus_client) and a C compiler for its fast paths
$(RUN_STAMP): setup.cfg pyproject.toml setup.py
	$(call apt_install,$(RUN_APT_PKGS))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip setuptools wheel
	$(PY) -m pip install -q -e .
	touch $@

# everything the tests, benchmarks and docs use
$(STAMP): $(RUN_STAMP) setup.cfg pyproject.toml setup.py
	$(call apt_install,$(TEST_APT_PKGS))
	@# the [torch] extra: torch's CPU build first (plain `torch` resolves to the CUDA build,
	@# several GB; on this machine pip finds 2.13.0+cpu in its local wheel directory)
	$(PY) -m pip install -q 'torch==$(TORCH_VERSION)'
	$(PY) -m pip install -q -e '.[test,bench,torch,ray,docs]'
	@# pyverbs comes from Debian (python3-pyverbs), not PyPI: link it into the venv
	ln -sfn /usr/lib/python3/dist-packages/pyverbs "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/pyverbs"
	touch $@

deps: $(STAMP) native

# the compiled fast paths: `pip install -e` builds them in place; these rebuild them when
# the C sources change (shm://, tcp:// and rdma:// run their Python paths where they are not
# built). The demo's three need gcc and python3-dev only; rdma://'s also needs verbs.h (libibverbs-dev).
EXT := $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
NATIVE_RUN := transport/_shmfast$(EXT) transport/_tcpfast$(EXT) gateway/_combine$(EXT)
NATIVE := $(NATIVE_RUN) transport/_rdmafast$(EXT)
$(NATIVE_RUN) &: transport/_shmfast.c transport/_tcpfast.c transport/_fastpath.h gateway/_combine.c setup.py | $(RUN_STAMP)
	$(PY) setup.py -q build_ext --inplace
transport/_rdmafast$(EXT): transport/_rdmafast.c transport/_fastpath.h setup.py | $(STAMP)
	$(PY) setup.py -q build_ext --inplace
native-run: $(NATIVE_RUN)
native: $(NATIVE)

run: $(RUN_STAMP) native-run
	$(PY) -m gateway.demo --backend $(BACKEND)

test: $(STAMP) native
	@mkdir -p $(OUT)
	@# rdma-marked tests need a device: they run in the rxe guest below (on the host they would only skip)
	@# MOE_REQUIRE_TORCH=1: the transformers checks fail rather than skip if the extra is missing
	@# MOE_REQUIRE_NATIVE=1: the compiled fast paths must have been built (their tests fail, not skip)
	@# the docs site first: a broken link, anchor or page fails the build
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(OUT)/site
	MOE_REQUIRE_TORCH=1 MOE_REQUIRE_NATIVE=1 $(PY) -m pytest -q -p no:cacheprovider -m "not rdma" --junitxml=$(OUT)/junit-host.xml tests
	@# the guest has no torch: transformers' outputs and the checkpoints it checks come from here
	$(PY) -m tests.models_fixture
	@# --timeout: the guest session (one-device and two-host tests) takes ~16 min on a loaded
	@# 2-core machine; the harness's default of 20 min is too close
	$(PY) -m tests.rxe.vm test --timeout 2700 --out $(OUT)/rdma -- tests/rdma -q
	@# the two-host tests (tests/rdma/two_hosts) run inside that same guest session; a run
	@# without them (or with any of them skipped) fails here
	$(PY) -m tests.summary --require tests.rdma.two_hosts $(OUT)/junit-host.xml $(OUT)/rdma/junit.xml

# the docs site (docs/, mkdocs.yml) into site/; `$(VENV)/bin/mkdocs serve` to browse it
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

test-host: $(STAMP) native
	MOE_REQUIRE_TORCH=1 MOE_REQUIRE_NATIVE=1 $(PY) -m pytest -q -m "not rdma" tests

test-rdma: $(STAMP) native
	$(PY) -m tests.models_fixture
	$(PY) -m tests.rxe.vm test --timeout 2700 --out $(OUT)/rdma -- tests/rdma -q
	$(PY) -m tests.summary --require tests.rdma.two_hosts $(OUT)/rdma/junit.xml

bench: $(STAMP) native
	$(VENV)/bin/moe-bench transport --json bench-results/transport.json

# rdma:// beside perftest (ib_send_lat, ib_send_bw, ib_write_bw) on the rxe device in the guest
RDMA_SIZES ?= 64,4K,64K,1M
bench-rdma: $(STAMP) native
	@mkdir -p bench-results
	$(PY) -m tests.rxe.vm run --out bench-results -- python3 -m bench.cli transport --backend rdma \
	  --sizes $(RDMA_SIZES) --json /mnt/job/out/rdma.json
	@echo "wrote bench-results/rdma.json"

# rdma:// across the guest's two-host link (the timed side on host A's rxe device, the echo
# side on host B's, through veths and a bridge) beside the one-device loopback rows: ours,
# the bare pyverbs loop and perftest, same sizes, same guest run (tests/rxe/bench_two_hosts.py)
bench-rdma-two-hosts: $(STAMP) native
	@mkdir -p bench-results
	$(PY) -m tests.rxe.vm run --out bench-results -- python3 -m tests.rxe.bench_two_hosts \
	  --sizes 64,4K,1M --json /mnt/job/out/rdma-two-hosts.json
	@echo "wrote bench-results/rdma-two-hosts.json (and its -loopback/-link runs)"

bench-moe: $(STAMP) native
	$(VENV)/bin/moe-bench moe --json bench-results/moe.json

# pipelined rounds by batch size: one worker beside the gateway, each size five times on
# fresh processes; the share of the bound realized, with its range, as a table and a plot
CHUNK_BATCHES ?= 2048 4096 8192 16384
bench-chunks: $(STAMP) native
	$(VENV)/bin/moe-bench moe --backend shm --local-workers 1 --d-ff 256 $(foreach b,$(CHUNK_BATCHES),--batch $(b)) \
	  --repeat 5 --rounds 3 --batches 4 --json bench-results/moe-chunks.json --plot bench-results/moe-chunks.png

# the issue's load: full config, a ramp to saturation, ours beside the peers in one run
bench-load: $(STAMP) native
	$(VENV)/bin/moe-bench load --mode ramp --full --systems all --backend shm --rate 12 --ramp-start 1.5 \
	  --ramp-steps 8 --step-duration 10 --concurrency 32 --warmup 2 --json bench-results/load-ramp.json \
	  --plot bench-results/load-ramp.png --markdown bench-results/load-ramp.md

# --placement ray beside --local-workers on a local 3-node Ray cluster in network namespaces
# (root): tokens/s, p99, start-up and recovery, interleaved rounds
bench-ray: $(STAMP)
	@mkdir -p bench-results
	$(SUDO) $(PY) -m bench.ray_figures --rounds 3 --requests 400 --json bench-results/ray-figures.json

# the compose deployment's shared secret: made once, readable by its owner only (gitignored)
secret: deploy/secret
deploy/secret:
	@umask 077 && python3 -c "import secrets; print(secrets.token_hex(32))" > $@.tmp && mv $@.tmp $@ \
	  && echo "created $@ (mode 0600)"

compose-check: $(STAMP) deploy/secret
	docker-compose -f docker-compose.yml config -q && echo "docker-compose.yml: valid"

# the Kubernetes manifests against the Kubernetes schemas, offline (tests/test_k8s.py also
# validates them with the RDMA patches applied, and runs their commands)
k8s-check: $(STAMP)
	$(VENV)/bin/kubernetes-validate --strict $$(find deploy/k8s -name '*.yaml' | sort)

bench-micro: $(STAMP) native
	$(PY) -m pytest -q -p no:cacheprovider bench/micro --benchmark-only --benchmark-columns=min,median,mean,ops

clean:
	rm -rf $(OUT) bench-results .pytest_cache site
