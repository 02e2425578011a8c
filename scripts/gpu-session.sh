#!/usr/bin/env bash
# One call on the GPU machine: install the wheels carried in .whl/ (cuDNN frontend, nvmath) and
# the project (building the CUDA plugin's shipped kernels), then run the steps named on the command line, writing logs to $OUT (or /tmp/out):
#
#   scripts/gpu-session.sh smoke tests conformance bench
#
#   smoke        scripts/gpu_smoke.py (foundation checks)
#   tests        scripts/gpu-test.sh (every cuda-marked test)
#   conformance  the ONNX node suite on [CUDA, CPU] (JSON per case) and on CPU alone
#   bench        benchmarks/models.py --fp16 $BENCH_ARGS (exports the models first)
#   cold         benchmarks/cold_start.py $COLD_ARGS (fresh processes)
#
# tests run in $GPU_TEST_SHARDS (default 4) parallel pytest processes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/cuda || exit 1
# the plugin's shipped kernels, for this GPU (the install's second step, as in the README)
python3 -m onnxplug_cuda.build_kernels || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
rc=0
for step in "$@"; do
    echo "=== $step"
    t0=$SECONDS
    case "$step" in
        smoke) python3 scripts/gpu_smoke.py > "$out/smoke.log" 2>&1; r=$?; tail -3 "$out/smoke.log" ;;
        tests) GPU_TEST_SHARDS=${GPU_TEST_SHARDS:-4} PYTHON=python3 bash scripts/gpu-test.sh -p no:cacheprovider > "$out/gpu-tests.log" 2>&1; r=$?
               grep -E "^(FAILED|ERROR)|gpu-test: passed" "$out/gpu-tests.log" | head -60 ;;
        conformance)
            ONNXPLUG_CONFORMANCE_TRACE=1 PYTHONFAULTHANDLER=1 python3 -m onnxplug.cli.main conformance --provider CUDAExecutionProvider --provider CPUExecutionProvider --json "$out/conformance_cuda.json" > "$out/conformance_cuda.log" 2>&1; r=$?
            grep -v "^case " "$out/conformance_cuda.log" | tail -3; grep "^case " "$out/conformance_cuda.log" | tail -1
            python3 -m onnxplug.cli.main conformance --provider CPUExecutionProvider --json "$out/conformance_cpu.json" > "$out/conformance_cpu.log" 2>&1
            tail -1 "$out/conformance_cpu.log" ;;
        bench) python3 benchmarks/models.py --fp16 ${BENCH_ARGS:-} --json "$out/bench.json" > "$out/bench.log" 2>&1; r=$?
               grep -E "^\|" "$out/bench.log" ;;
        cold) # bytecode as a regular install has it (this machine sets PYTHONDONTWRITEBYTECODE,
              # and its numpy, cuda-python and CuPy came without: each process compiled
              # cuda.pathfinder's modules, among others, during session creation)
              python3 -m compileall -q -j 8 src plugins/cuda/src ${PYTHONPATH:-} $(python3 -c "import os, numpy, cupy, cupy_backends, cuda.bindings as b; print(os.path.dirname(numpy.__file__), os.path.dirname(os.path.dirname(b.__file__)), os.path.dirname(cupy.__file__), os.path.dirname(cupy_backends.__file__))") > /dev/null
              python3 benchmarks/cold_start.py ${COLD_ARGS:-} --json "$out/cold.json" > "$out/cold.log" 2>&1; r=$?
              grep -E "^\|" "$out/cold.log" ;;
        *) echo "unknown step $step"; r=2 ;;
    esac
    echo "=== $step: exit $r in $((SECONDS - t0)) s"
    [[ $r -ne 0 ]] && rc=$r
done
exit $rc
