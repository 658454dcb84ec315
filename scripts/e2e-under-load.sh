#!/usr/bin/env bash
# Run the end-to-end group several times in a row while a busy loop takes one CPU core, so a test
# that only passes on a fast, idle machine shows here before it shows in CI.
#
#   scripts/e2e-under-load.sh [ROUNDS] [PYTEST ARGS...]    (default: 3 rounds of `-m e2e`)
#
# Prints one line per round (passed/failed counts, minutes) and a JSON object at the end; exits
# non-zero if any round failed. The busy loop is pinned with taskset to the last core and killed
# (by its pid) when the script ends, however it ends.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

rounds=${1:-3}
shift || true
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(-m e2e)
core=$(( $(nproc) - 1 ))

taskset -c "$core" bash -c 'while :; do :; done' &
load_pid=$!
trap 'kill "$load_pid" 2>/dev/null || true' EXIT

results=()
failed_rounds=0
for r in $(seq 1 "$rounds"); do
    log=$(mktemp)
    t=$SECONDS
    set +e
    .venv/bin/python -m pytest -q -p no:cacheprovider "${args[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    secs=$(( SECONDS - t ))
    line=$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
    rm -f "$log"
    echo "round $r: exit $rc; ${line:-no summary}; $(( secs / 60 )) min $(( secs % 60 )) s" >&2
    results+=("{\"round\": $r, \"exit\": $rc, \"seconds\": $secs, \"summary\": \"${line//\"/}\"}")
    [ "$rc" -eq 0 ] || failed_rounds=$(( failed_rounds + 1 ))
done
printf '{"rounds": [%s], "failed_rounds": %d, "load": "busy loop pinned to core %d of %d"}\n' \
    "$(IFS=,; echo "${results[*]}")" "$failed_rounds" "$core" "$(nproc)"
[ "$failed_rounds" -eq 0 ]
