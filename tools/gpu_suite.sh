#!/usr/bin/env bash
# Every GPU test and the decode benchmark in one device-machine call; logs under $OUT (or ./gpu-out), table last.
#   bash tools/gpu_suite.sh [tests|bench|all]     (default all)
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
what=${1:-all}
status=0
if [[ $what == tests || $what == all ]]; then
    python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/test_cuda_kernels.py tests/test_cuda_backend.py tests/test_cuda_worker.py \
        $(ls tests/test_cuda_quant.py 2>/dev/null) 2>&1 | tee "$OUT/tests.log"
    status=$?
fi
if [[ $what == bench || $what == all ]]; then
    python3 -m bench.decode --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
fi
echo "==== summary ===="
[[ -f $OUT/tests.log ]] && tail -n 1 "$OUT/tests.log"
[[ -f $OUT/bench.log ]] && sed -n '/^| budget/,$p' "$OUT/bench.log"
exit $status
