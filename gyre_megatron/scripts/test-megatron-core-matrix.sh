#!/usr/bin/env bash
# Run gyre-megatron's megatron-marked tests once more against each other supported megatron-core
# release (the project venv holds the newest, 0.16.x), reusing the project venv: megatron-core
# alone (a 2.6 MB wheel, no dependencies needed) goes into .venv/mcore-<version>/, which
# PYTHONPATH puts in front of the venv's site-packages, for pytest and for the rank processes it
# spawns. About 5 s of install and 60-70 s of tests per release on the 2-core CI machine. Run
# after `make setup`. Prints one JSON line per release: version, exit code, seconds.
#
#   test-megatron-core-matrix.sh [VERSION ...]     (default: 0.13.1 0.14.0 0.15.3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.13.1 0.14.0 0.15.3)
rc=0
for version in "${versions[@]}"; do
    target=.venv/mcore-$version
    if [ ! -f "$target/.complete" ]; then
        rm -rf "$target"
        .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --target "$target" \
            "megatron-core==$version"
        touch "$target/.complete"
    fi
    got=$(PYTHONPATH="$PWD/$target" .venv/bin/python -c 'from megatron.core import package_info as p; print(p.__version__)' 2>/dev/null)
    [ "$got" = "$version" ] || { echo "expected megatron-core $version on PYTHONPATH, got $got" >&2; exit 1; }
    echo "gyre-megatron: megatron-marked tests against megatron-core $got" >&2
    t0=$(date +%s)
    one=0
    PYTHONPATH="$PWD/$target" .venv/bin/python -m pytest -m megatron integration_tests/megatron -q -W ignore || one=$?
    echo "{\"megatron_core\": \"$version\", \"rc\": $one, \"seconds\": $(( $(date +%s) - t0 ))}"
    [ "$one" -eq 0 ] || rc=$one
done
exit "$rc"
