#!/usr/bin/env bash
# Run ON the GPU machine, from the repository root, after carrying the folder that
# bench/gpu_wheels.sh filled (default .whl): installs those wheels into /tmp/site (no network
# needed), points the launcher at the carried etcd, joins the SmolLM2 GGUF when both halves
# were carried, then runs the suite (its results go to $OUT, else bench/results):
#
#   bash bench/gpu_run.sh [bench/gpu_suite.py flags, e.g. --smoke or --no-gateway]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${WHEELS:-.whl}
if compgen -G "$DIR/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$DIR"/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -x "$DIR/etcd" ] && export ETCD_BIN=$PWD/$DIR/etcd
args=()
if [ -f "$DIR-smollm2-a/part" ] && [ -f "$DIR-smollm2-b/part" ]; then
    gguf=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "$DIR-smollm2-a/part" "$DIR-smollm2-b/part" > "$gguf"
    if [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat "$DIR-smollm2-b/sha256")" ]; then
        args+=(--smollm2-gguf "$gguf")
    else
        echo "gpu_run: the SmolLM2 halves do not join to the original file; using random weights" >&2
    fi
fi
export PYTHONUNBUFFERED=1
exec python3 -m bench.gpu_suite "${args[@]}" "$@"
