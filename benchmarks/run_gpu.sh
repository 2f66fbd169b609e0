#!/usr/bin/env bash
# The CUDA checks and timings in one run, for a machine with a CUDA GPU and torch, lightning,
# torchmetrics and numba installed (the package itself is used from this checkout):
#
#     bash benchmarks/run_gpu.sh [DATA_DIR]
#
# (jsonschema too: install it, e.g. `python3 -m pip install --no-index --target DIR wheels/*.whl`
# and put DIR on PYTHONPATH, where the machine has no package index.)
# DATA_DIR holds mnist/*.gz for the Lightning epoch (default ../shared/data; synthetic data of
# MNIST's shape when absent). Logs go to $OUT (default ./gpu_out).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
DATA="${1:-../shared/data}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, lightning, torchmetrics, numba; print('torch', torch.__version__,
'lightning', lightning.__version__, 'torchmetrics', torchmetrics.__version__, 'numba',
numba.__version__, torch.cuda.get_device_name(), 'CPU threads', torch.get_num_threads())"
echo "== prox on CUDA"
"$PY" benchmarks/bench_prox.py --device cuda --no-naive --markdown \
    --shapes 784-200-10,784-200-1,784-1000-10,512-512-512,4096-4096-10 2>&1 | tee "$OUT/prox_cuda.md"
echo "== CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_spec_torch.py 2>&1 \
    | tee "$OUT/tests_cuda.log" | tail -20
echo "== Lightning epoch on the GPU (with and without PathNormProx's finiteness check)"
for flag in "" --no-check-finite; do
    "$PY" benchmarks/bench_lightning_epoch.py --accelerator gpu --repeats 3 --data-dir "$DATA" \
        $flag 2>&1 | grep -E "repeat|median|ratio|alone|torch|Error" | tee -a "$OUT/lightning_gpu.log"
done
echo "== prox on this machine's CPU (all cores)"
"$PY" benchmarks/bench_prox.py --no-naive --markdown \
    --shapes 784-200-10,784-1000-10,512-512-512,4096-4096-10 2>&1 | tee "$OUT/prox_cpu.md"
echo "== parallel kernel tests on all cores"
"$PY" -m pytest -q -p no:cacheprovider tests/test_kernel_parallel.py 2>&1 | tail -5
