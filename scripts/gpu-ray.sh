#!/usr/bin/env bash
# On the GPU machine (no package index): install the Ray wheels that scripts/ray-wheels.sh
# fetched (the first half already copied to /tmp/raywhl by the call before, the rest in
# .whl-ray/2), the CUDA plugin's wheels from .whl and the project, then run the GPU tests of the
# Ray integration, the CPU-cluster Ray tests and benchmarks/ray_scale.py, logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/raywhl
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
cp .whl-ray/2/* /tmp/raywhl/ 2>/dev/null
if ls /tmp/raywhl/ray.whl.part-* >/dev/null 2>&1; then
    cat /tmp/raywhl/ray.whl.part-* > "/tmp/raywhl/$(cat /tmp/raywhl/ray.whl.name)" || exit 1
    rm /tmp/raywhl/ray.whl.part-*
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl /tmp/raywhl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/cuda || exit 1
python3 -c "import ray, ray.data, ray.serve; print('ray', ray.__version__)" || exit 1
rc=0
python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_ray_gpu.py tests/test_ray.py \
    2>&1 | tee "$out/ray-tests.log" | tail -15
[[ ${PIPESTATUS[0]} -ne 0 ]] && rc=1
python3 benchmarks/ray_scale.py --json "$out/ray_scale.json" "$@" > "$out/ray_scale.log" 2>&1 || rc=1
grep -E "^\||overhead|differ|latency|^ResNet|^resnet|^Ray Serve" "$out/ray_scale.log"
exit $rc
