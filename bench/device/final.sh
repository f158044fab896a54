#!/usr/bin/env bash
# On the GPU machine, after the model is carried (../shared/device/README.md): the kernels' and GPU tests,
# `make bench` (decode probe, engine bench, services load run) and the same load run with ghz
# (GHZ=path of a ghz binary). Keeps at most 8 files in $OUT.
set -uo pipefail
out=${OUT:-device-out}; work=/tmp/specdec-bench; mkdir -p "$out" "$work"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -2 >> "$out/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -12 >> "$out/gpu.txt"
timeout 330 python3 -m bench.run --out "$work" 2>&1 | tail -60 > "$out/bench.txt"
cp "$work/summary.md" "$work/summary.json" "$work/decode_probe.md" "$out/" 2>/dev/null
if [ -n "${GHZ:-}" ]; then
  timeout 200 python3 -m bench.ghz_load --ghz "$GHZ" --colocate off --out "$work/ghz" > "$out/ghz.txt" 2>&1
  cp "$work/ghz/ghz.md" "$out/" 2>/dev/null
fi
