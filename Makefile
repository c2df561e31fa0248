# The project's entry points. `make run` and `make test` are the README's two commands.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian packages: pyverbs/rdma-core (not on PyPI), and the real services the ops tests run
# gcc and python3-dev: setup.py compiles shm://'s and rdma://'s fast paths (transport/_shmfast.c,
# transport/_rdmafast.c; libibverbs-dev for the latter's verbs.h)
APT_PKGS := python3-pyverbs rdma-core ibverbs-providers iproute2 docker-compose prometheus gcc python3-dev libibverbs-dev
BACKEND ?= shm
TORCH_VERSION ?= 2.13.0
OUT := build

.PHONY: deps native run test test-host test-rdma bench bench-micro bench-rdma bench-moe bench-chunks bench-load bench-ray compose-check k8s-check secret clean

$(STAMP): setup.cfg pyproject.toml setup.py
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then echo "apt: installing $$missing"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $$missing; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	@# the [torch] extra: torch's CPU build first (plain `torch` resolves to the CUDA build,
	@# several GB; on this machine pip finds 2.13.0+cpu in its local wheel directory)
	$(PY) -m pip install -q 'torch==$(TORCH_VERSION)'
	$(PY) -m pip install -q -e '.[test,bench,torch,ray]'
	@# pyverbs comes from Debian (python3-pyverbs), not PyPI: link it into the venv
	ln -sfn /usr/lib/python3/dist-packages/pyverbs "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/pyverbs"
	touch $@

deps: $(STAMP) native

# the compiled fast paths: `pip install -e` builds them in place; this rebuilds them when
# the C sources change (shm:// and rdma:// run their Python paths where they are not built)
EXT := $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
NATIVE := transport/_shmfast$(EXT) transport/_rdmafast$(EXT) gateway/_combine$(EXT)
$(NATIVE) &: transport/_shmfast.c transport/_rdmafast.c transport/_fastpath.h gateway/_combine.c setup.py | $(STAMP)
	$(PY) setup.py -q build_ext --inplace
native: $(NATIVE)

run: $(STAMP) native
	$(PY) -m gateway.demo --backend $(BACKEND)

test: $(STAMP) native
	@mkdir -p $(OUT)
	@# rdma-marked tests need a device: they run in the rxe guest below (on the host they would only skip)
	@# MOE_REQUIRE_TORCH=1: the transformers checks fail rather than skip if the extra is missing
	@# MOE_REQUIRE_NATIVE=1: the compiled fast paths must have been built (their tests fail, not skip)
	MOE_REQUIRE_TORCH=1 MOE_REQUIRE_NATIVE=1 $(PY) -m pytest -q -p no:cacheprovider -m "not rdma" --junitxml=$(OUT)/junit-host.xml tests
	@# the guest has no torch: transformers' outputs and the checkpoints it checks come from here
	$(PY) -m tests.models_fixture
	$(PY) -m tests.rxe.vm test --out $(OUT)/rdma -- tests/rdma -q
	$(PY) -m tests.summary $(OUT)/junit-host.xml $(OUT)/rdma/junit.xml

test-host: $(STAMP) native
	MOE_REQUIRE_TORCH=1 MOE_REQUIRE_NATIVE=1 $(PY) -m pytest -q -m "not rdma" tests

test-rdma: $(STAMP) native
	$(PY) -m tests.models_fixture
	$(PY) -m tests.rxe.vm test --out $(OUT)/rdma -- tests/rdma -q

bench: $(STAMP) native
	$(VENV)/bin/moe-bench transport --json bench-results/transport.json

# rdma:// beside perftest (ib_send_lat, ib_send_bw, ib_write_bw) on the rxe device in the guest
RDMA_SIZES ?= 64,4K,64K,1M
bench-rdma: $(STAMP) native
	@mkdir -p bench-results
	$(PY) -m tests.rxe.vm run --out bench-results -- python3 -m bench.cli transport --backend rdma \
	  --sizes $(RDMA_SIZES) --json /mnt/job/out/rdma.json
	@echo "wrote bench-results/rdma.json"

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
	rm -rf $(OUT) bench-results .pytest_cache
