#!/usr/bin/env bash
# On the GPU machine, after the model is carried: the engine-step probe and the long-prompt-under-load
# run, into $OUT.
set -uo pipefail
out=${OUT:-device-out}; mkdir -p "$out"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt"
timeout 200 python3 -m bench.decode_probe --out "$out" > "$out/probe.log" 2>&1
timeout 240 python3 -m bench.prefill_stall --colocate off --out "$out" > "$out/stall.log" 2>&1
