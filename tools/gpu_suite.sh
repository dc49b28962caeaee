#!/usr/bin/env bash
# Every GPU test and benchmark in one device-machine call; logs under $OUT (or ./gpu-out), a summary table last.
#   bash tools/gpu_suite.sh [tests|bench|prefill-bench|worker|all ...]   (several at once; default: tests bench)
#     tests          every `gpu`-marked test file (test_cuda_*, and the benches' test_bench_*), each in a process of
#                    its own (a kernel fault poisons the CUDA context for the rest of a process, so one bad kernel
#                    cannot hide the other files' results)
#     worker         the CPU worker-protocol suite run against the CUDA backend (~3 min)
#     bench          bench/decode.py (makes the Qwen3-30B-A3B-shaped model on the device, ~15 s)
#     prefill-bench  bench/prefill.py at 1K and 4K prompts, all resident and 12 GiB
#     prefill-long   bench/prefill.py at 8K and 32K
#     gemm           bench/moe_gemm.py at 1K, 4K and 8K tokens
#     sampler        bench/sampler.py: the GPU sampler's cost a pick per sampling chain (~30 s)
#     recipes        tests/test_cuda_recipe_fixtures.py, a process per MoE family (needs ../shared/anchors' wheel)
# GPU_SUITE_JOBS=N runs the test parts' processes N at a time (the H200 has room for many tiny-model processes, and
# device time is what a session has least of); a bench part waits for every test before it starts, so its figures
# are measured on an idle GPU.
# On the device machine run it on a snapshot of the committed tree, so helpers' uncommitted edits never travel:
#   here:   echo /.snap/ >> .git/info/exclude; rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap
#   there:  (carry .whl, .snap, .fixtures) cd .snap && ln -s ../.fixtures .fixtures && OUT=$OUT bash tools/gpu_suite.sh
# SmolLM2 (for test_smollm2_greedy_and_logits) travels in two calls (64 MiB a call): call A carries .whl and .smol_a
# and runs `mkdir -p /root/keep && cp .smol_a/part00 /root/keep/`; call B, at once (warm 30 s), carries .whl and
# .smol_b (+ what else fits) and runs this; the model is assembled below and checked by its sha256.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
# at most 8 files come back from a device call: the logs go to one folder, packed into $OUT/gpu-logs.tgz at the end
LOG=$(mktemp -d)
[[ $# -eq 0 ]] && set -- tests bench
status=0
SMOL=data/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -f $SMOL && -f /root/keep/part00 && -f .smol_b/part01 ]]; then
    mkdir -p data/models && cat /root/keep/part00 .smol_b/part01 > "$SMOL.part" && mv "$SMOL.part" "$SMOL"
    python3 -c "import hashlib,sys; from engine.default_model import SMOLLM2_SHA256 as h; \
sys.exit(hashlib.sha256(open('$SMOL','rb').read()).hexdigest() != h)" || { echo "SmolLM2 sha256 mismatch"; rm -f "$SMOL"; }
fi
JOBS=${GPU_SUITE_JOBS:-1}
report() {   # report NAME: its exit status and last line
    local rc
    rc=$(cat "$LOG/$1.rc")
    # 5: pytest collected nothing (a file whose tests are all CPU ones, deselected by -m gpu)
    [[ $rc -ne 0 && $rc -ne 5 ]] && { status=1; echo "[$1] exit $rc"; }
    tail -n 1 "$LOG/$1.log"
}
run_one() {
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" > "$LOG/$name.log" 2>&1
    echo $? > "$LOG/$name.rc"
}
run() {   # run NAME SECONDS command...: log to $LOG/NAME.log, keep going on failure
    if (( JOBS > 1 )); then
        while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n; done
        run_one "$@" &
        pending+=("$1")
    else
        run_one "$@"
        report "$1"
    fi
}
pending=()
settle() {   # wait for the background test processes, then report them in the order they started
    wait
    local name
    for name in "${pending[@]}"; do report "$name"; done
    pending=()
}
summary() {
    echo "==== summary ===="
    for f in "$LOG"/t-*.log "$LOG"/worker-cuda.log; do [[ -f $f ]] && echo "$(basename "$f" .log): $(tail -n 1 "$f")"; done
    for f in "$LOG"/bench.log "$LOG"/prefill*.log; do [[ -f $f ]] && sed -n "/^model /,\$p" "$f"; done
    for f in "$LOG"/gemm*.log; do [[ -f $f ]] && grep -E "^bench.moe_gemm|^\| [0-9]" "$f"; done
    [[ -f $LOG/sampler.log ]] && cat "$LOG/sampler.log"
    mkdir -p "$OUT" && tar -czf "$OUT/gpu-logs.tgz" -C "$LOG" .
}
# killed by an outer timeout (the device call's limit): still print and pack what finished, so a long suite's
# results are never lost with its last file
trap 'trap - TERM INT; echo "==== interrupted: the files still running have no result ===="; summary; exit 124' TERM INT
PT="python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short"
for what in "$@"; do
    case $what in
    tests)
        for f in tests/test_cuda_*.py tests/test_bench_*.py; do
            [[ $f == tests/test_cuda_compile.py ]] && continue
            # the recipes part runs this file a process per family
            [[ $f == tests/test_cuda_recipe_fixtures.py && " $* " == *" recipes "* ]] && continue
            # GPU_SUITE_SKIP="quant kernels": files already verified at this commit's kernels, to save device time
            [[ " ${GPU_SUITE_SKIP:-} " == *" $(basename "$f" .py | sed 's/^test_cuda_//') "* ]] && continue
            run "t-$(basename "$f" .py | sed 's/^test_cuda_//')" 300 $PT "$f"
        done ;;
    recipes)
        for fam in qwen3moe qwen2moe mixtral "not qwen3moe and not qwen2moe and not mixtral"; do
            name=${fam%% *}
            run "t-recipes-${name/not/dense}" 400 $PT tests/test_cuda_recipe_fixtures.py -k "$fam"
        done ;;
    worker)
        run worker-cuda 400 env STRATA_TEST_BACKEND=cuda python3 -m pytest -q -p no:cacheprovider --tb=short \
            tests/test_worker_protocol.py ;;
    bench)
        settle
        run bench 560 python3 -m bench.decode --prefetch both --out "$LOG/bench.json" ;;
    prefill-bench)
        settle
        run prefill 300 python3 -m bench.prefill --prompts 1024,4096 --budgets all,12 --out "$LOG/prefill.json" ;;
    prefill-long)
        settle
        run prefill-long 400 python3 -m bench.prefill --prompts 8192,32768 --budgets all,12 \
            --out "$LOG/prefill-long.json" ;;
    gemm)
        settle
        run gemm 120 python3 -m bench.moe_gemm --tokens 1024,4096,8192 ;;
    sampler)
        settle
        run sampler 120 python3 -m bench.sampler ;;
    *) echo "unknown part: $what"; status=2 ;;
    esac
done
settle
summary
exit $status
