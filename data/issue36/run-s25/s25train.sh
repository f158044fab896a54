# Session 25, GPU pair: two heads from the shipped head on the 119,025 responses, the vocabulary rebuilt with
# the default --vocab-swap-ratio 3: R as is (GPU 0), S with --source-weights sharegpt=3 (GPU 1). Sourced after join.sh.
set -o pipefail
for v in r s; do
  python -m training.pipeline unpack --workdir /tmp/w$v --from .devcarry/gen117 > /tmp/unpack-$v.log 2>&1 || { cat /tmp/unpack-$v.log; exit 1; }
done
common="--device cuda --batch-size 64 --lr 6e-4 --total-train-minutes 7.4 --train-minutes 7.4 --minutes 8.6 --init-head models/eagle3-smollm2"
CUDA_VISIBLE_DEVICES=0 TORCH_LOGS=recompiles PYTHONUNBUFFERED=1 python -m training.pipeline train --workdir /tmp/wr $common > /tmp/train-r.log 2>&1 &
pr=$!
CUDA_VISIBLE_DEVICES=1 TORCH_LOGS=recompiles PYTHONUNBUFFERED=1 python -m training.pipeline train --workdir /tmp/ws $common --source-weights sharegpt=3 > /tmp/train-s.log 2>&1 &
ps=$!
wait $pr; echo "train r rc=$?"; wait $ps; echo "train s rc=$?"
for v in r s; do
  tail -n 4 /tmp/train-$v.log; grep -c "Recompiling" /tmp/train-$v.log; grep -i -E "vocab|kept|new tokens" /tmp/train-$v.log | head -3
  tar cf - -C /tmp/w$v head train/train_log.jsonl | split -b 15M - $OUT/head-$v.tar.
done
gzip -c /tmp/train-r.log > $OUT/train-r.log.gz; gzip -c /tmp/train-s.log > $OUT/train-s.log.gz
ls -la $OUT
