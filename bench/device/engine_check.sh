#!/usr/bin/env bash
# On the GPU machine, after `source .devcarry/b/unpack.sh` (../shared/device/README.md): the Triton
# kernels against their reference, the GPU tests, and either the engine-step probe (default) or, with
# BENCH=1, the whole `make bench` run (which includes the probe). Keeps at most 8 files in $OUT.
set -uo pipefail
out=${OUT:-device-out}; work=/tmp/specdec-bench; mkdir -p "$out" "$work"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -20 | tee "$out/kernels.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -40 | tee "$out/gpu_tests.txt"
if [ "${BENCH:-0}" = 1 ]; then
  timeout 480 python3 -m bench.run --out "$work" --prompts 16 --max-new-tokens 128 --concurrency 1,4,16 \
    --hf-prompts 2 2>&1 | tail -60 > "$out/bench.txt"
  cp "$work/summary.md" "$work/summary.json" "$work/decode_probe.json" "$work/decode_probe.md" "$out/" 2>/dev/null
else
  timeout 240 python3 -m bench.decode_probe --out "$work" -v 2>&1 | tail -120 > "$out/probe.txt"
  cp "$work/decode_probe.json" "$work/decode_probe.md" "$out/"
fi
