#!/usr/bin/env bash
# Every GPU test and the decode benchmark in one device-machine call; logs under $OUT (or ./gpu-out), table last.
#   bash tools/gpu_suite.sh [tests|bench|all|prefill-bench]     (default all; prefill-bench: bench/prefill.py only)
# SmolLM2 for test_smollm2_greedy_and_logits travels in two calls (64 MiB a call): call A carries .whl and .smol_a
# and runs `mkdir -p /root/keep && cp .smol_a/part00 /root/keep/`; call B, at once (warm 30 s), carries .whl,
# .smol_b, .fixtures/reference and .fixtures/vocab/tiny-bpe-1024.gguf and runs this with `tests` (the bench's
# qwen2 vocabulary does not fit beside .smol_b); the model is assembled below and checked by its sha256.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
what=${1:-all}
status=0
SMOL=data/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -f $SMOL && -f /root/keep/part00 && -f .smol_b/part01 ]]; then
    mkdir -p data/models && cat /root/keep/part00 .smol_b/part01 > "$SMOL.part" && mv "$SMOL.part" "$SMOL"
    python3 -c "import hashlib,sys; from engine.default_model import SMOLLM2_SHA256 as h; \
sys.exit(hashlib.sha256(open('$SMOL','rb').read()).hexdigest() != h)" || { echo "SmolLM2 sha256 mismatch"; rm -f "$SMOL"; }
fi
if [[ $what == tests || $what == all ]]; then
    # Q2_K blocks (tiny-qwen2moe-mixed) have tripped a misaligned load in quant.cuh, which poisons the CUDA context
    # for the rest of a process: those tests run in a process of their own.
    python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -k "not qwen2moe" \
        tests/test_cuda_kernels.py tests/test_cuda_backend.py tests/test_cuda_worker.py 2>&1 | tee "$OUT/tests.log"
    status=$?
    python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -k qwen2moe \
        tests/test_cuda_backend.py tests/test_cuda_worker.py 2>&1 | tee "$OUT/tests-q2k.log" || status=1
    STRATA_TEST_BACKEND=cuda python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_worker_protocol.py 2>&1 \
        | tee "$OUT/tests-worker-cuda.log" || status=1
    # the streamed prompt pass (--prefill streamed, opt-in): its kernels, then end to end (qwen2moe apart, as above)
    python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_cuda_prefill_kernels.py 2>&1 \
        | tee "$OUT/tests-prefill-kernels.log" || status=1
    python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -k "not qwen2moe" tests/test_cuda_prefill_streamed.py \
        2>&1 | tee "$OUT/tests-prefill-streamed.log" || status=1
    python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -k qwen2moe tests/test_cuda_prefill_streamed.py \
        2>&1 | tee "$OUT/tests-prefill-streamed-q2k.log" || status=1
    if [[ -f tests/test_cuda_quant.py ]]; then
        python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_cuda_quant.py 2>&1 \
            | tee "$OUT/tests-quant.log" || status=1
    fi
fi
if [[ $what == bench || $what == all ]]; then
    python3 -m bench.decode --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
fi
if [[ $what == prefill-bench ]]; then
    # the streamed prompt pass at 1K/4K/8K (the 4K targets), then 32K on its own (its KV cache takes ~6 GiB)
    python3 -m bench.prefill --prompts 1024,4096,8192 --out "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.log" || status=1
    python3 -m bench.prefill --prompts 32768 --budgets all,16,12 --out "$OUT/prefill32k.json" 2>&1 \
        | tee "$OUT/prefill32k.log" || status=1
fi
echo "==== summary ===="
for f in "$OUT"/tests*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done
[[ -f $OUT/bench.log ]] && sed -n "/^model /,\$p" "$OUT/bench.log"
for f in "$OUT"/prefill*.log; do [[ -f $f ]] && sed -n "/^model /,\$p" "$f"; done
exit $status
