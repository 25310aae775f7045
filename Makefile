# SpecMesh: `make up` starts the local mesh, `make test` runs the test suite.
# Both create .venv on first use and install what they need into it: `make up` only what
# serving needs (`pip install -e .`), `make test` the test extra too (every other extra).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On these machines the CPU torch wheel lies in /opt/wheels; elsewhere PyPI serves it.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP := $(BIN)/python -m pip install --disable-pip-version-check $(FIND_LINKS) -c constraints.txt
ARGS ?=
PYTEST_ARGS ?=

.PHONY: up test install install-test proto demo-models clean-venv

# Serving: gateway, drafter, verifier, `specmesh up`, `specmesh generate`.
$(VENV)/.installed-serve: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools wheel
	$(PIP) -e .
	$(BIN)/python -m services.cpu_kernels || echo "CPU kernels not prebuilt: a replica builds them on first use, or keeps float32 weights"
	touch $@

# The test suite and everything it exercises (bench, training, Kubernetes discovery).
$(VENV)/.installed-test: $(VENV)/.installed-serve
	$(PIP) -e '.[test]'
	touch $@

install: $(VENV)/.installed-serve

install-test: $(VENV)/.installed-test

up: install
	$(BIN)/specmesh up $(ARGS)

test: install-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Regenerate the committed gRPC stubs in specmesh/v1 from proto/ (grpcio-tools: test extra).
proto: install-test
	$(BIN)/python specmesh/protogen.py

# Train the demo target on the stdlib, distill its drafter, measure the pair and render the
# model card, with the settings of the committed pair (~1.5 h + 30 min on a 2-core CPU;
# see docs/models.md).
demo-models: install-test
	$(BIN)/python -m training.demo --out models/demo-target --save-dtype float16 --resume \
		--hidden 384 --layers 6 --heads 6 --kv-heads 3 --intermediate 1056 --steps 800 \
		--warmup 50 --threads 1 $(ARGS)
	$(BIN)/specmesh distill --target models/demo-target --out models/demo-drafter --resume \
		--layers 2 --hidden 128 --steps 800 --seq-len 256 --batch-size 8 --threads 2 \
		--save-dtype float16
	$(BIN)/python -m training.evaluate --target models/demo-target --draft models/demo-drafter --threads 2 --json models/demo-eval.json
	$(BIN)/python -m training.card --models models

clean-venv:
	rm -rf $(VENV)
