# Sourced on the GPU machine from the project's root once .devcarry/p1..p3's model parts are in
# /tmp/specdec-model (bench/device/train_head.sh says how to carry them): joins them and checks the sum against
# .devcarry/b/model.sha256, then sources .devcarry/b/unpack.sh (../shared/device/unpack.sh, copied there by
# prepare-carry.sh), which finds the model whole and installs the wheels and exports SPECDEC_GGUF and PYTHONPATH.
d=/tmp/specdec-model
if [ ! -f "$d/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  if [ ! -f "$d/gpart_ac" ]; then echo "join_model.sh: model parts missing: the machine was given back?" >&2; return 1; fi
  cat "$d/gpart_aa" "$d/gpart_ab" "$d/gpart_ac" > "$d/SmolLM2-135M-Instruct.Q4_1.gguf" && rm -f "$d"/gpart_*
  cp .devcarry/b/model.sha256 "$d/"
  (cd "$d" && sha256sum -c --quiet model.sha256) || { echo "join_model.sh: checksum mismatch" >&2; return 1; }
fi
source .devcarry/b/unpack.sh
