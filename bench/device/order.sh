#!/usr/bin/env bash
# On the GPU machine, after the model is carried: plain and policy requests alternated twice at
# concurrency 16 and 64 (run order effects), into $OUT.
set -uo pipefail
out=${OUT:-device-out}; mkdir -p "$out"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
timeout 240 python3 -m bench.services_bench --device cuda --ipc on --concurrency 16,64 --prompts 24 \
  --max-new-tokens 128 --requests-per-worker 4 --max-context 1024 \
  --modes plain,spec,plain,spec --out "$out" > "$out/order.log" 2>&1
grep -E "tok/s total" "$out/order.log"
