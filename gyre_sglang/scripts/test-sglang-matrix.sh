#!/usr/bin/env bash
# Run gyre-sglang's smoke subset against another supported SGLang release (the project venv holds
# the newest, 0.5.23, which every sglang-marked test runs on): server start with Gyre's plugin,
# the intake gate and role swap, abort, engine auth, and a weight load over Mooncake seen in what
# the engine samples. The release's wheel alone (its other pins equal 0.5.23's on this stack, but
# openai, which stays at the venv's) goes into .venv/sglang-<version>/, in front of the venv's
# site-packages on PYTHONPATH, together with Gyre's CPU-patch site folder for the test process
# itself (0.5.22 imports CUDA-only modules at import time). Run after `make setup`. Prints one
# JSON line per release.
#
#   test-sglang-matrix.sh [VERSION ...]     (default: 0.5.22)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.5.22)
site=$(.venv/bin/python -c 'from gyre_sglang.server import cpu_patch_site; print(cpu_patch_site())')
rc=0
for version in "${versions[@]}"; do
    target=.venv/sglang-$version
    if [ ! -f "$target/.complete" ]; then
        rm -rf "$target"
        .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --target "$target" \
            "sglang==$version"
        touch "$target/.complete"
    fi
    export GYRE_SGLANG_CPU_PATCH=1 PYTHONPATH="$site:$PWD/$target"
    got=$(.venv/bin/python -c 'from importlib.metadata import version; import sglang; print(version("sglang"), sglang.__file__)')
    case "$got" in
        "$version $PWD/$target/"*) ;;
        *) echo "expected sglang $version from $target, got $got" >&2; exit 1 ;;
    esac
    echo "gyre-sglang: smoke subset against sglang $version" >&2
    t0=$(date +%s)
    one=0
    .venv/bin/python -m pytest -q -p no:cacheprovider \
        integration_tests/sglang/test_client.py integration_tests/sglang/test_role_swap.py \
        integration_tests/sglang/test_engine_auth.py \
        "integration_tests/sglang/test_weight_publication.py::test_a_published_policy_changes_what_the_engine_samples" \
        || one=$?
    echo "{\"sglang\": \"$version\", \"rc\": $one, \"seconds\": $(( $(date +%s) - t0 ))}"
    unset GYRE_SGLANG_CPU_PATCH PYTHONPATH
    [ "$one" -eq 0 ] || rc=$one
done
exit "$rc"
