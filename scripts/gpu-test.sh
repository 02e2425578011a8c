#!/usr/bin/env bash
# Run the GPU tests (pytest marker "cuda") on a machine with an NVIDIA GPU
# (GPU_TEST_SHARDS=N runs them in N parallel pytest processes).
#
#   scripts/gpu-test.sh [extra pytest args...]
#
# Uses $PYTHON if set, else .venv/bin/python if the repo has that venv (the one the README's
# commands create), else python3. Installs onnxplug (with its test extra) and, when
# plugins/cuda holds a package, the CUDA plugin, both editable, unless they already import;
# then runs the cuda-marked tests and prints their counts. Without a GPU (or without the
# plugin) those tests skip, so the counts say what really ran.
set -euo pipefail

cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi
echo "gpu-test: python: $py ($("$py" --version 2>&1))"

# Install only what is missing, so that a prepared machine (or one without a package index)
# runs the tests as they are.
if ! "$py" -c "import onnxplug, pytest" >/dev/null 2>&1; then
    echo "gpu-test: installing onnxplug with its test extra"
    "$py" -m pip install -q -e ".[test]"
fi
if [[ -f plugins/cuda/pyproject.toml ]]; then
    if ! "$py" -c "import onnxplug_cuda" >/dev/null 2>&1; then
        echo "gpu-test: installing the CUDA plugin from plugins/cuda"
        "$py" -m pip install -q -e plugins/cuda
    fi
else
    echo "gpu-test: no plugins/cuda/pyproject.toml: running without a CUDA plugin"
fi

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
    echo "gpu-test: nvidia-smi not found: the cuda tests will skip"
fi

log=$(mktemp)
trap 'rm -f "$log"*' EXIT
set +e
shards=${GPU_TEST_SHARDS:-1}
if [[ $shards -le 1 ]]; then
    "$py" -m pytest -m cuda -v -rs "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    summaries=$(grep -E '^=+ .*(passed|failed|skipped|error|deselected|no tests ran).* in [0-9.]+s' "$log" | tail -1)
else
    # GPU_TEST_SHARDS=N: the test files split into N pytest processes sharing the GPU (the tests
    # are mostly host-bound, so this divides the wall time); files are dealt out by test count.
    mapfile -t groups < <("$py" -m pytest -m cuda --collect-only -q -p no:cacheprovider 2>/dev/null \
        | grep '::' | cut -d: -f1 | sort | uniq -c | sort -rn \
        | awk -v n="$shards" '{ i = 0; for (k = 1; k < n; k++) if (load[k] < load[i]) i = k;
                               load[i] += $1; files[i] = files[i] " " $2 }
                             END { for (k = 0; k < n; k++) print files[k] }')
    pids=()
    for i in "${!groups[@]}"; do
        [[ -z "${groups[$i]// }" ]] && continue
        # shellcheck disable=SC2086
        "$py" -m pytest -m cuda -v -rs "$@" ${groups[$i]} > "$log.$i" 2>&1 &
        pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || { r=$?; [[ $r -ne 5 ]] && rc=$r; }; done
    cat "$log".* > "$log"
    cat "$log"
    summaries=$(grep -hE '^=+ .*(passed|failed|skipped|error|deselected|no tests ran).* in [0-9.]+s' "$log".*)
fi
set -e

# pytest's closing lines, e.g. "=== 12 passed, 1 failed, 3 skipped in 4.2s ===", summed as counts
count() { grep -oE "[0-9]+ $1" <<<"$summaries" | grep -oE '^[0-9]+' | awk '{ s += $1 } END { print s + 0 }'; }
echo "gpu-test: passed=$(count passed) failed=$(count failed) errors=$(count 'errors?') skipped=$(count skipped) deselected=$(count deselected)"

if [[ $rc -eq 5 ]]; then
    echo "gpu-test: no test is marked cuda yet"
    exit 0
fi
exit "$rc"
