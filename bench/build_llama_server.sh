#!/usr/bin/env bash
# Builds llama.cpp's own server (the continuous-batching peer of bench/engine_concurrency.py)
# from the llama-cpp-python source distribution for the CPU at hand: AVX2/FMA always, the
# AVX-512 family (VNNI, VBMI, BF16) where /proc/cpuinfo lists it, AMX always off (a native
# build enables AMX kernels that crash on these machines; see ../shared/BENCH.md).
#   bench/build_llama_server.sh [WORKDIR] [ISA]    # prints the binary's path; 5-15 min on 2 cores
# ISA `avx2` builds without any AVX-512 or AVX-VNNI kernel (into build-avx2/), the build an
# AVX2-only CPU gets: the peer for `--isa avx2` runs of bench/engine_concurrency.py and
# bench/engine_cpu.py on a machine that has more. `avxvnni` (build-avxvnni/) adds AVX-VNNI
# where the CPU has it (an Alder Lake's build); `avx512` (build-avx512/) the AVX-512 family
# less BF16 (a Cascade Lake's or Ice Lake's): the peers for `--isa avxvnni` / `--isa avx512`.
# llama-bench is built beside the server.
set -euo pipefail
work="${1:-${TMPDIR:-/tmp}/llama-server-build}"
isa="${2:-native}"
version=0.3.36
mkdir -p "$work"
cd "$work"
if [ ! -d "llama_cpp_python-$version" ]; then
    python -m pip download "llama-cpp-python==$version" --no-deps --no-binary :all: -d . >&2
    tar xzf "llama_cpp_python-$version.tar.gz"
fi
cd "llama_cpp_python-$version/vendor/llama.cpp"
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
build=build
case "$isa" in
    native) ;;
    avx2) build=build-avx2; has() { echo OFF; } ;;
    avxvnni) build=build-avxvnni; has() { [ "$1" = avx_vnni ] && grep -qw avx_vnni /proc/cpuinfo && echo ON || echo OFF; } ;;
    avx512) build=build-avx512; has() { [ "$1" != avx512_bf16 ] && grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; } ;;
    *) echo "ISA must be native, avx512, avxvnni or avx2, not $isa" >&2; exit 2 ;;
esac
cmake -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_F16C=ON \
    -DGGML_FMA=ON -DGGML_BMI2=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI="$(has avx_vnni)" \
    -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)" \
    -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$build" --target llama-server llama-bench -j "$(nproc)" >&2
echo "$PWD/$build/bin/llama-server"
