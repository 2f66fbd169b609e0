#!/usr/bin/env bash
# The CUDA checks and timings in one run (under 6 minutes on an H100), for a machine with a CUDA
# GPU and torch, triton, lightning, torchmetrics and numba installed (the package itself is used
# from this checkout):
#
#     bash benchmarks/run_gpu.sh [DATA_DIR]
#
# jsonschema (for the spec vectors) is installed from the wheels in .whl/ when the machine lacks
# it and has no package index (bring .whl/ along). DATA_DIR holds mnist/*.gz for the Lightning
# epoch (default $PATHNORM_DATA_DIR; synthetic data of MNIST's shape when absent). Logs go to $OUT
# (default ./gpu_out). Each step has its own time limit, so one that hangs cannot eat the rest.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
DATA="${1:-${PATHNORM_DATA_DIR:-}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
START=$(date +%s)
step() { echo "== $1 ($(($(date +%s) - START)) s into the run)"; }

if ! "$PY" -c "import jsonschema" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    DEPS="${TMPDIR:-/tmp}/pathnorm_deps"
    "$PY" -m pip install -q --no-index --no-deps --target "$DEPS" .whl/*.whl 2>&1 | tail -2
    export PYTHONPATH="$PYTHONPATH:$DEPS"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton, lightning, torchmetrics, numba; print('torch', torch.__version__,
'triton', triton.__version__, 'lightning', lightning.__version__, 'torchmetrics',
torchmetrics.__version__, 'numba', numba.__version__, torch.cuda.get_device_name())
try:
    import jsonschema; print('jsonschema', jsonschema.__version__)
except ImportError:
    print('no jsonschema: the spec-vector tests skip')" 2>&1 | tee -a "$OUT/gpu.txt"

step "Triton prox vs sort prox (CUDA graph) vs one SGD step"
timeout 90 "$PY" benchmarks/bench_triton.py --shapes 784-200-10,784-1000-10,4096-4096-10 2>&1 \
    | tee "$OUT/prox_triton.md"

step "tests on the GPU: test_triton.py in four processes (Triton compiles each kernel configuration once per process, on one core), test_cuda.py"
T=tests/test_triton.py
ONE="spec_vectors or float32 or scale or tiny or lam_from"
TEST_GROUPS=("random_units" "$ONE" "paper_shapes"
    "not (random_units or paper_shapes or $ONE)")
pids=()
for i in 0 1 2 3; do
    timeout 170 "$PY" -m pytest -q -p no:cacheprovider "$T" -k "${TEST_GROUPS[$i]}" \
        >"$OUT/tests_triton_$i.log" 2>&1 &
    pids+=($!)
done
timeout 170 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py >"$OUT/tests_cuda.log" 2>&1 &
pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done
for log in "$OUT"/tests_triton_*.log "$OUT/tests_cuda.log"; do
    echo "-- $log"
    grep -E "passed|failed|error|FAILED|ERROR|Timeout" "$log" | tail -12
done

step "Lightning epoch on the GPU (PathNormProx with method auto; with and without its check)"
for flag in "" --no-check-finite; do
    timeout 50 "$PY" benchmarks/bench_lightning_epoch.py --accelerator gpu --repeats 3 \
        ${DATA:+--data-dir "$DATA"} $flag 2>&1 | grep -E "repeat|median|ratio|alone|torch|Error" \
        | tee -a "$OUT/lightning_gpu.log"
done
step "done"
