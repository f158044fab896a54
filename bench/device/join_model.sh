# Sourced on the GPU machine from the project's root once .devcarry/p1..p3's model parts are in
# /tmp/specdec-model (bench/device/train_head.sh says how to carry them): joins them and checks the sum against
# .devcarry/b/model.sha256, then sources .devcarry/b/unpack.sh (../shared/device/unpack.sh, copied there by
# prepare-carry.sh), which finds the model whole and installs the wheels and exports SPECDEC_GGUF and PYTHONPATH.
d=/tmp/specdec-model
if [ ! -f "$d/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  if ! ls "$d"/gpart_* > /dev/null 2>&1; then echo "join_model.sh: model parts missing: the machine was given back?" >&2; return 1; fi
  cat $(ls "$d"/gpart_* | sort) > "$d/SmolLM2-135M-Instruct.Q4_1.gguf"
  cp .devcarry/b/model.sha256 "$d/"
  if ! (cd "$d" && sha256sum -c --quiet model.sha256); then
    rm -f "$d/SmolLM2-135M-Instruct.Q4_1.gguf"  # parts missing or damaged: carry the missing ones and source again
    echo "join_model.sh: checksum mismatch (parts there: $(cd "$d" && ls gpart_* | tr '\n' ' '))" >&2; return 1
  fi
  rm -f "$d"/gpart_*
fi
source .devcarry/b/unpack.sh
