#!/usr/bin/env bash
# One model shape on the GPU machine, Strata beside llama.cpp at the same budgets (issues' bench tables):
#   bash tools/gpu_bench_families.sh PRESET [BUDGETS]     e.g. gpt-oss-20b all,8,6   qwen3next-80b-a3b all,24,12
# makes the model with tools.make_moe (the qwen hybrids in llama-quantize's Q4_K_M recipe; gpt-oss as the published
# files are: MXFP4 experts), then bench.decode, bench.prefill (4K prompt) and bench.llama_bench, and prints one table
# (bench.vs_llama). Models over 40 GB go to /dev/shm (the GPU machine's disk has ~51 GB free) and are deleted after,
# on a failure too; smaller ones stay in /tmp for the next call while the machine is warm. Logs and JSON under $OUT
# (or ./gpu-out), each bench's rows written as they are measured.
# llama-bench: LLAMA_BENCH (default /tmp/llama-bench, else .lbench/ or .anchors/llama-bench.{xz,gz} carried into the
# checkout; xz: the .gz is 44 MB and a call carries 64 MiB in all).
# Each call must end inside the device's 10 minutes: the 80B and 120b shapes take one call each. gpt-oss-120b (63 GB
# in /dev/shm) runs in one call of DEADLINE seconds (default 540): its file and a whole pinned arena (61 GB) would
# not both fit the 128 GiB of RAM, so its benches pin what RAM holds beside the file (--resident-budget-gib auto,
# bench/host_ram.py) and read the rest from the file; one backend a budget times decode and the 4K prompt
# (bench.decode --prefill-prompts), and llama-bench picks its layer counts from one-batch probes and measures once
# (--probe --reps 1). Each step has a time limit so the model is deleted before the device's limit.
# ROUTING=trained|spread makes the model with make_moe --routing (routing over time like a trained model's, or tokens
# routing nearly independently); unset, bench.decode's --attn-gain 3 (the spread end). The file's name says which.
# DRY_RUN=1 prints the steps and runs none.
set -o pipefail
cd "$(dirname "$0")/.."
PRESET=${1:?usage: gpu_bench_families.sh PRESET [BUDGETS]}
BUDGETS=${2:-all,12}
OUT=${OUT:-gpu-out}
DEADLINE=${DEADLINE:-540}
ONE_BACKEND=0; MEMORY=(); LLAMA_OPTS=()
case $PRESET in
    gpt-oss-20b) DIR=/tmp; RECIPE=() ;;
    gpt-oss-120b) DIR=/dev/shm; RECIPE=(); ONE_BACKEND=1; MEMORY=(--resident-budget-gib auto)
                  LLAMA_OPTS=(--probe --reps 1) ;;
    qwen35moe-35b-a3b) DIR=/tmp; RECIPE=(--make-recipe q4_k_m) ;;
    qwen3next-80b-a3b) DIR=/dev/shm; RECIPE=(--make-recipe q4_k_m) ;;
    *) echo "gpu_bench_families: unknown preset $PRESET (gpt-oss-20b, gpt-oss-120b, qwen35moe-35b-a3b," \
            "qwen3next-80b-a3b)"; exit 2 ;;
esac
case ${ROUTING:-} in ""|trained|spread) ;; *) echo "gpu_bench_families: ROUTING is trained or spread, not $ROUTING"; exit 2 ;; esac
MODEL=$DIR/$PRESET${ROUTING:+-$ROUTING}.gguf
BENCH_SCRIPT=gpu_bench_families
source tools/bench_steps.sh     # BENCH, say, left, min, step, shm_room
cleanup() { [[ $DIR == /dev/shm && ${DRY_RUN:-0} != 1 ]] && rm -f "$MODEL" "$MODEL.part"; }
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM
status=0
say "$PRESET at $BUDGETS: $MODEL (deadline ${DEADLINE}s)"
if [[ $DIR == /dev/shm && ! -f $MODEL && ${DRY_RUN:-0} != 1 ]]; then
    shm_room "$(python3 -m tools.make_moe --preset "$PRESET" "${RECIPE[@]/--make-recipe/--recipe}" --dry-run |
                awk '$1 == "total" {print int($(NF-1) + 1)}')"
fi
if [[ ! -f $MODEL ]]; then
    step make 200 "$OUT/$PRESET-make.log" python3 -c 'import sys; from pathlib import Path; from bench.decode import make_model
print("made in", round(make_model(Path(sys.argv[1]), recipe=sys.argv[3] or None, preset=sys.argv[2],
                                  routing=sys.argv[4] or None), 1), "s")' \
        "$MODEL" "$PRESET" "${RECIPE[1]:-}" "${ROUTING:-}" || { say "no model: stopping"; exit 1; }
fi
if (( ONE_BACKEND )); then
    # decode and the 4K prompt on one backend a budget; llama.cpp gets what is left but for 15 s of clean-up
    step strata $(( $(left) - 215 )) "$OUT/$PRESET-decode.log" python3 -m bench.decode --model "$MODEL" \
        --budgets "$BUDGETS" "${MEMORY[@]}" --no-profile --no-sampled --new 128 --prefill-prompts 4096 \
        --prefill-out "$OUT/$PRESET-prefill.json" --out "$OUT/$PRESET-decode.json" || status=1
else
    step decode 600 "$OUT/$PRESET-decode.log" python3 -m bench.decode --model "$MODEL" --make-preset "$PRESET" \
        "${RECIPE[@]}" --budgets "$BUDGETS" "${MEMORY[@]}" --no-profile --no-sampled --new 128 \
        --out "$OUT/$PRESET-decode.json" || status=1
    step prefill 600 "$OUT/$PRESET-prefill.log" python3 -m bench.prefill --model "$MODEL" --make-preset "$PRESET" \
        "${RECIPE[@]}" --prompts 4096 --budgets "$BUDGETS" "${MEMORY[@]}" --no-profile \
        --out "$OUT/$PRESET-prefill.json" || status=1
fi
rm -f "$OUT/$PRESET-llama.jsonl"
lt=$(( $(left) - 15 ))
step llama-bench "$lt" "$OUT/$PRESET-llama.log" python3 -m bench.llama_bench --model "$MODEL" --bench "$BENCH" \
    --budgets "$BUDGETS" "${LLAMA_OPTS[@]}" --timeout "$(( lt > 20 ? lt - 10 : 10 ))" \
    --out "$OUT/$PRESET-llama.jsonl" || status=1
cleanup
echo "==== $PRESET: Strata beside llama.cpp ===="
[[ ${DRY_RUN:-0} == 1 ]] || python3 -m bench.vs_llama "$OUT/$PRESET-decode.json" "$OUT/$PRESET-prefill.json" \
    "$OUT/$PRESET-llama.jsonl"
say "done, exit $status"
exit $status
