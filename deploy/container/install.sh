#!/bin/sh
# The image's second stage (deploy/container/Dockerfile), also run by CI in a clean environment:
# install the wheels in WHEELS (from build-wheels.sh) into a new virtual environment at PREFIX,
# from those files alone, then check that the compiled core loads and router-serve starts.
set -eu
wheels=${1:?usage: install.sh WHEELS PREFIX}
prefix=${2:?usage: install.sh WHEELS PREFIX}
python3 -m venv "$prefix"
"$prefix/bin/python" -m pip install --quiet --no-cache-dir --no-index --find-links "$wheels" kv-affinity-router
# the compiled ring, not its pure-Python twin (ROUTER_NO_EXTENSIONS is not set in the image)
env -u ROUTER_NO_EXTENSIONS "$prefix/bin/python" -c 'import router.ring as r; assert r.IMPLEMENTATION == "compiled", r.IMPLEMENTATION'
"$prefix/bin/router-serve" --help >/dev/null
