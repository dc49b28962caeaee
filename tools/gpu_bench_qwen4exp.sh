#!/usr/bin/env bash
# Qwen3.8-Flash-Next (qwen4exp) on the GPU machine, Strata beside llama.cpp on the same file (issue 35, item 6):
#   bash tools/gpu_bench_qwen4exp.sh short [BUDGETS]   decode at a ~0 context (512-token prompt) and the 4K prompt at
#                                                       each budget (default all,12,8,24: in that order, so a run
#                                                       cut at the deadline loses 24 first; all first learns the
#                                                       profile on a measured row instead of an extra pass)
#   bash tools/gpu_bench_qwen4exp.sh long  [BUDGET]    at one budget (default 12): decode at 32K and 128K contexts,
#                                                       prompts of 4K and 32K; llama-bench at -d 32768 / 131072
#                                                       with every expert in VRAM (at the budget: minutes a rep)
# Each is one device call of DEADLINE seconds (default 540): it makes the model in /dev/shm (a warm machine keeps
# /dev/shm files only ~30 s between calls), benches it and deletes it, on a failure too; every bench's rows are
# written as they are measured and a step that runs out of time is cut, so partial rows still print.
# The model: tools.make_moe --preset qwen3.8-flash-next --pack PACK (default q2_0; iq2_xs: IQ2_XS gate/up experts)
# --ple-rows PLE_ROWS (default 14,400,000: a 1.3 GB n-gram table, as the outside generator's file of the anchors'
# table; the published 320,001,536 rows are 26.8 GiB, which with the 35 GiB of the rest would not leave the pinned
# arena room in 128 GiB of RAM beside /dev/shm). A smaller table changes which rows n-grams share and the row
# cache's hit rate, not the bytes a token reads (16 rows of 90 bytes) nor any other tensor.
# ROUTING=trained|spread: make_moe --routing (unset: the preset's own); the file's name says which.
# llama-bench: LLAMA_BENCH (default /tmp/llama-bench, else .anchors/llama-bench.{xz,gz} carried into the checkout).
# DRY_RUN=1 prints the steps and runs none.
set -o pipefail
cd "$(dirname "$0")/.."
CALL=${1:?usage: gpu_bench_qwen4exp.sh short|long [BUDGETS]}
PACK=${PACK:-q2_0}
PLE_ROWS=${PLE_ROWS:-14400000}
OUT=${OUT:-gpu-out}
DEADLINE=${DEADLINE:-540}
case $CALL in
    short) BUDGETS=${2:-all,12,8,24} ;;
    long) BUDGETS=${2:-12}
          [[ $BUDGETS == *,* ]] && { echo "gpu_bench_qwen4exp: long takes one budget, not $BUDGETS"; exit 2; } ;;
    *) echo "gpu_bench_qwen4exp: the call is short or long, not $CALL"; exit 2 ;;
esac
case $PACK in q2_0|iq2_xs) ;; *) echo "gpu_bench_qwen4exp: PACK is q2_0 or iq2_xs, not $PACK"; exit 2 ;; esac
case ${ROUTING:-} in ""|trained|spread) ;; *) echo "gpu_bench_qwen4exp: ROUTING is trained or spread, not $ROUTING"; exit 2 ;; esac
[[ $PLE_ROWS =~ ^[0-9]+$ ]] || { echo "gpu_bench_qwen4exp: PLE_ROWS is a row count, not $PLE_ROWS"; exit 2; }
NAME=qwen3.8-flash-next-$PACK-ple$PLE_ROWS${ROUTING:+-$ROUTING}
MODEL=/dev/shm/$NAME.gguf
MAKE=(python3 -m tools.make_moe --preset qwen3.8-flash-next --pack "$PACK" --ple-rows "$PLE_ROWS" ${ROUTING:+--routing "$ROUTING"})
BENCH_SCRIPT=gpu_bench_qwen4exp
source tools/bench_steps.sh     # BENCH, say, left, min, step, shm_room
cleanup() { [[ ${DRY_RUN:-0} != 1 ]] && rm -f "$MODEL" "$MODEL.part"; }
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM
status=0
say "$CALL at $BUDGETS: $MODEL (deadline ${DEADLINE}s)"
if [[ ${DRY_RUN:-0} != 1 ]]; then
    shm_room "$("${MAKE[@]}" --dry-run | awk '$1 == "total" {print int($(NF-1) + 1)}')"
fi
# 39 GB; 2.6 GB (2 layers) took 16 s on 2 cores here; 16 threads on the GPU machine: ~60 s expected
step make 240 "$OUT/$NAME-make.log" "${MAKE[@]}" --out "$MODEL" || { say "no model: stopping"; exit 1; }
C=(--model "$MODEL" --no-profile --no-sampled --new 128)
if [[ $CALL == short ]]; then
    # one backend a budget times decode and the 4K prompt; llama.cpp gets what is left but for 15 s of clean-up
    step strata $(( $(left) - 230 )) "$OUT/$NAME-decode.log" python3 -m bench.decode "${C[@]}" --budgets "$BUDGETS" \
        --prompt 512 --prefill-prompts 4096 --prefill-out "$OUT/$NAME-prefill.json" --out "$OUT/$NAME-decode.json" \
        || status=1
    rm -f "$OUT/$NAME-llama.jsonl"
    lt=$(( $(left) - 15 ))
    step llama-bench "$lt" "$OUT/$NAME-llama.log" python3 -m bench.llama_bench --model "$MODEL" --bench "$BENCH" \
        --budgets "$BUDGETS" --prompt 4096 --gen 128 --probe --reps 1 --timeout "$(( lt > 20 ? lt - 10 : 10 ))" \
        --out "$OUT/$NAME-llama.jsonl" || status=1
    cleanup
    echo "==== $NAME: Strata beside llama.cpp (decode after a 512-token prompt, prompt 4K) ===="
    [[ ${DRY_RUN:-0} == 1 ]] || python3 -m bench.vs_llama "$OUT/$NAME-decode.json" "$OUT/$NAME-prefill.json" \
        "$OUT/$NAME-llama.jsonl"
    # bench.decode's own table: each row's PCIe and HBM ceilings (printed when its step finished)
    [[ ${DRY_RUN:-0} == 1 ]] || grep -E '^(model |\| )' "$OUT/$NAME-decode.log" | head -n 12
else
    # Strata: the 32K context with the 4K and 32K prompts on its backend, then the 128K context (each row prefills its
    # prompt three times: the learning pass with every expert in VRAM, the row's own learning pass, the measured one;
    # the host reads 16 PLE rows a prompt token, ~5 us a row through engine/row_cache.py on the 2-core dev box)
    step strata-32k $(min 130 $(( $(left) - 340 ))) "$OUT/$NAME-ctx32k.log" python3 -m bench.decode "${C[@]}" \
        --budgets "$BUDGETS" --prompt 32768 --prefill-prompts 4096,32768 --prefill-out "$OUT/$NAME-prefill.json" \
        --out "$OUT/$NAME-ctx32k.json" || status=1
    step strata-128k $(min 200 $(( $(left) - 140 ))) "$OUT/$NAME-ctx128k.log" python3 -m bench.decode "${C[@]}" \
        --budgets "$BUDGETS" --prompt 131072 --out "$OUT/$NAME-ctx128k.json" || status=1
    # llama.cpp at the depths with every expert in VRAM only: at the budget its prompt pass (~150 tok/s on the
    # anchors' file at 11.7 GiB) would take 3.6 min for the 32K depth and 15 for the 128K, each rep
    rm -f "$OUT/$NAME-llama-d32768.jsonl" "$OUT/$NAME-llama-d131072.jsonl"
    for d in 32768 131072; do
        if (( d == 32768 )); then lt=$(min 70 $(( $(left) - 70 ))); else lt=$(( $(left) - 15 )); fi
        step "llama-bench-d$d" "$lt" "$OUT/$NAME-llama-d$d.log" python3 -m bench.llama_bench --model "$MODEL" \
            --bench "$BENCH" --budgets all --prompt 0 --gen 128 --depth "$d" --reps 1 \
            --timeout "$(( lt > 20 ? lt - 10 : 10 ))" --out "$OUT/$NAME-llama-d$d.jsonl" || status=1
    done
    cleanup
    echo "==== $NAME: Strata beside llama.cpp at long contexts (budget $BUDGETS GiB) ===="
    [[ ${DRY_RUN:-0} == 1 ]] || python3 -m bench.vs_llama_ctx --budget "$BUDGETS" \
        --decode 32768="$OUT/$NAME-ctx32k.json" --decode 131072="$OUT/$NAME-ctx128k.json" \
        --llama 32768="$OUT/$NAME-llama-d32768.jsonl" --llama 131072="$OUT/$NAME-llama-d131072.jsonl" \
        --prefill "$OUT/$NAME-prefill.json"
fi
say "done, exit $status"
exit $status
