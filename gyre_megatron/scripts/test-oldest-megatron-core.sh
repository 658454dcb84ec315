#!/usr/bin/env bash
# Run gyre-megatron's megatron-marked tests a second time, against the oldest supported
# megatron-core (0.13.x), reusing the project venv: megatron-core alone (a 2.6 MB wheel, no
# dependencies needed) goes into .venv/mcore-<version>/, which PYTHONPATH puts in front of the
# venv's site-packages, for pytest and for the rank processes it spawns. About 5 s of install
# and ~65 s of tests on the 2-core CI machine. Run after `make setup`.
#
#   GYRE_MCORE_OLDEST=0.13.1   the release to test (default 0.13.1)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
version=${GYRE_MCORE_OLDEST:-0.13.1}
target=.venv/mcore-$version
if [ ! -f "$target/.complete" ]; then
    rm -rf "$target"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --target "$target" \
        "megatron-core==$version"
    touch "$target/.complete"
fi
got=$(PYTHONPATH="$PWD/$target" .venv/bin/python -c 'from megatron.core import package_info as p; print(p.__version__)')
[ "$got" = "$version" ] || { echo "expected megatron-core $version on PYTHONPATH, got $got" >&2; exit 1; }
echo "gyre-megatron: megatron-marked tests against megatron-core $got" >&2
PYTHONPATH="$PWD/$target" exec .venv/bin/python -m pytest -m megatron integration_tests/megatron -q -W ignore "$@"
