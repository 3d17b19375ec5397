#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (CPU only, Release, no TLS, no web UI) from the llama.cpp sources
# that the llama-cpp-python sdist on PyPI carries, for the real-engine tests and benchmarks. The
# binary and a vocab-only model file from the same sources go to a cache folder, reused by every
# later run on this machine; the last line printed is the binary's path.
#
#   scripts/build-llama-server.sh            # build once (about 5-9 minutes on 2 cores), then cached
#   export KVAR_LLAMA_SERVER=$(scripts/build-llama-server.sh | tail -n 1)
#
# Settings: KVAR_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/kv-affinity-router), JOBS (default: all
# cores). Needs cmake, a C++ compiler and pip (to fetch the sdist).
set -euo pipefail

VERSION=0.3.36  # llama-cpp-python's sdist, which pins one llama.cpp commit
FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
)
VOCAB=ggml-vocab-llama-spm.gguf

for tool in cmake c++ python3; do
    command -v "$tool" >/dev/null || { echo "build-llama-server: $tool is needed and was not found" >&2; exit 1; }
done
cache_root=${KVAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kv-affinity-router}
# a native build runs only on CPUs like this one: the cache is keyed by the CPU's features too
cpu=$( (uname -m; grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true; echo "${FLAGS[*]}") | sha256sum | cut -c1-12)
dest="$cache_root/llama-server-$VERSION-$cpu"
if [ -x "$dest/llama-server" ] && [ -f "$dest/$VOCAB" ] && "$dest/llama-server" --version >/dev/null 2>&1; then
    echo "build-llama-server: cached in $dest" >&2
    echo "$dest/llama-server"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "build-llama-server: fetching the llama-cpp-python $VERSION sdist" >&2
python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
echo "build-llama-server: building llama-server (CPU, Release) in $work" >&2
start=$(date +%s)
cmake -S "$src" -B "$work/build" "${FLAGS[@]}" >"$work/cmake.log" 2>&1 || { tail -n 30 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "${JOBS:-$(nproc)}" >"$work/build.log" 2>&1 ||
    { tail -n 30 "$work/build.log" >&2; exit 1; }
mkdir -p "$dest.part"
cp "$work/build/bin/llama-server" "$src/models/$VOCAB" "$dest.part/"
cp "$src/LICENSE" "$dest.part/LICENSE.llama.cpp"
rm -rf "$dest" && mv "$dest.part" "$dest"
echo "build-llama-server: built in $(( $(date +%s) - start )) s, cached in $dest" >&2
echo "$dest/llama-server"
