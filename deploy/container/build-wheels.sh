#!/bin/sh
# The image's first stage (deploy/container/Dockerfile), also run by CI in a clean environment:
# build kv-affinity-router's wheel, with its compiled core, and the wheels of everything it needs,
# into DIR. Run from the source tree's root.
set -eu
out=${1:?usage: build-wheels.sh DIR}
python3 -m pip install --quiet --no-cache-dir --upgrade pip
python3 -m pip wheel --quiet --no-cache-dir --wheel-dir "$out" .
ls "$out"/kv_affinity_router-*.whl >/dev/null
