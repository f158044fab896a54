# Sourced on the GPU machine from the project's root once .devcarry/p1..p3's model parts are in
# /tmp/specdec-model (bench/device/train_head.sh says how to carry them): joins them, checks the sum against
# .devcarry/b/model.sha256, installs .devcarry/b/wheels into /tmp/site, and exports SPECDEC_GGUF and PYTHONPATH
# (what ../shared/device/unpack.sh does for the two-part layout). Later calls: it skips what is done.
d=/tmp/specdec-model
if [ ! -f "$d/SmolLM2-135M-Instruct.Q4_1.gguf" ] && [ -f "$d/gpart_aa" ]; then
  cat "$d/gpart_aa" "$d/gpart_ab" "$d/gpart_ac" > "$d/SmolLM2-135M-Instruct.Q4_1.gguf" && rm -f "$d"/gpart_*
  (cd "$d" && cp "$OLDPWD/.devcarry/b/model.sha256" . && sha256sum -c --quiet model.sha256) || { echo "join_model.sh: checksum mismatch" >&2; return 1; }
fi
if [ ! -f "$d/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then echo "join_model.sh: model missing: machine was given back" >&2; return 1; fi
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/b/wheels/*.whl && touch /tmp/site/.done
fi
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export SPECDEC_GGUF="$d/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "join_model.sh: model at $SPECDEC_GGUF"
