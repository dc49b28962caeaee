#!/usr/bin/env bash
# The quant layer's GPU checks and benchmark, in one device call (run from the repo root on the GPU machine):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && bash tools/gpu_quant_suite.sh
# Writes pytest's log, the benchmark table and its JSON under $OUT (or bench/out/ when OUT is unset).
set -uo pipefail
out="${OUT:-bench/out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import cupy, numpy, gguf; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda_quant.py 2>&1 | tee "$out/pytest_quant.txt" | tail -25
tests_rc=${PIPESTATUS[0]}
python3 bench/matvec.py ${BENCH_ARGS:-} --out "$out/matvec.json" 2>&1 | tee "$out/matvec.txt"
bench_rc=${PIPESTATUS[0]}
echo "suite: pytest rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
