#!/usr/bin/env bash
# Builds the llama.cpp the benches compare swarm with: the source vendored in the llama-cpp-python 0.3.36 sdist
# (the same ggml generation swarm's own binding carries), outside the repository, with the RPC backend and the
# server. Usage: deploy/build-llama-cpp.sh [PREFIX]   (default /work/llamacpp-build, where bench/_llama.py looks)
#
# GGML_NATIVE is off so the build does not depend on what the building host's compiler guesses (a VM that reports
# AMX it does not enable dies with SIGILL in ggml's AMX kernels); the x86 levels are named instead: AVX2, FMA, F16C,
# BMI2 always, and AVX-512 (F, VBMI, VNNI, BF16) where /proc/cpuinfo lists them, because llama.cpp is to be given its
# best on the machine that runs the comparison. LLAMA_AVX512=0 builds the AVX2 baseline swarm's ggml is built for.
# `nice -n 10`: the build shares its cores with whatever else runs.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=${1:-/work/llamacpp-build}
version=0.3.36
jobs=${JOBS:-$(nproc)}
src="$prefix/llama_cpp_python-$version"

mkdir -p "$prefix"
if [ ! -d "$src" ]; then
    python3 -m pip download "llama-cpp-python==$version" --no-deps --no-binary :all: -d "$prefix"
    tar xzf "$prefix/llama_cpp_python-$version.tar.gz" -C "$prefix"
fi

flags=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if [ "${LLAMA_AVX512:-1}" = 1 ] && grep -qw avx512f /proc/cpuinfo; then
    flags+=(-DGGML_AVX512=ON)
    grep -qw avx512vbmi /proc/cpuinfo && flags+=(-DGGML_AVX512_VBMI=ON)
    grep -qw avx512_vnni /proc/cpuinfo && flags+=(-DGGML_AVX512_VNNI=ON)
    grep -qw avx512_bf16 /proc/cpuinfo && flags+=(-DGGML_AVX512_BF16=ON)
fi

nice -n 10 cmake -S "$src/vendor/llama.cpp" -B "$prefix/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF "${flags[@]}" \
    -DGGML_RPC=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
nice -n 10 cmake --build "$prefix/build" -j "$jobs" \
    --target llama-bench llama-server llama-cli ggml-rpc-server llama-batched-bench llama-quantize llama-eval-callback

# swarm's own probe: llama.cpp's logits for given token ids (tests compare the engine with it on synthesized files)
vendor="$src/vendor/llama.cpp"
mapfile -t libs < <(find "$prefix/build" -name '*.a' | sort)
nice -n 10 g++ -O2 -std=c++17 "$repo/bench/llama_logits.cpp" -I "$vendor/include" -I "$vendor/ggml/include" \
    -Wl,--start-group "${libs[@]}" -Wl,--end-group -fopenmp -lpthread -ldl -o "$prefix/build/bin/swarm-llama-logits"

# The commit the vendored tree was cut at: the sdist carries no .git, so llama.cpp's own build number is the record.
"$prefix/build/bin/llama-bench" --version 2>&1 | tee "$prefix/BUILD_COMMIT"
