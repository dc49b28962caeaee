#!/usr/bin/env bash
# One model shape on the GPU machine, Strata beside llama.cpp at the same budgets (issues' bench tables):
#   bash tools/gpu_bench_families.sh PRESET [BUDGETS]     e.g. gpt-oss-20b all,8,6   qwen3next-80b-a3b all,24,12
# makes the model with tools.make_moe (the qwen hybrids in llama-quantize's Q4_K_M recipe; gpt-oss as the published
# files are: MXFP4 experts), then bench.decode, bench.prefill (4K prompt) and bench.llama_bench, and prints one table
# (bench.vs_llama). Models over 40 GB go to /dev/shm (the GPU machine's disk has ~51 GB free) and are deleted after;
# smaller ones stay in /tmp for the next call while the machine is warm. Logs and JSON under $OUT (or ./gpu-out).
# llama-bench: LLAMA_BENCH (default /tmp/llama-bench, else .lbench/ or .anchors/llama-bench.{xz,gz} carried into the
# checkout; xz: the .gz is 44 MB and a call carries 64 MiB in all).
# Each call must end inside the device's 10 minutes: the 80B and 120b shapes take one call each.
set -o pipefail
cd "$(dirname "$0")/.."
PRESET=${1:?usage: gpu_bench_families.sh PRESET [BUDGETS]}
BUDGETS=${2:-all,12}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
case $PRESET in
    gpt-oss-20b) DIR=/tmp; RECIPE=() ;;
    gpt-oss-120b) DIR=/dev/shm; RECIPE=() ;;
    qwen35moe-35b-a3b) DIR=/tmp; RECIPE=(--make-recipe q4_k_m) ;;
    qwen3next-80b-a3b) DIR=/dev/shm; RECIPE=(--make-recipe q4_k_m) ;;
    *) echo "gpu_bench_families: unknown preset $PRESET (gpt-oss-20b, gpt-oss-120b, qwen35moe-35b-a3b," \
            "qwen3next-80b-a3b)"; exit 2 ;;
esac
MODEL=$DIR/$PRESET.gguf
BENCH=${LLAMA_BENCH:-/tmp/llama-bench}
for cand in "$BENCH" .lbench/llama-bench.xz .anchors/llama-bench.xz .anchors/llama-bench.gz; do [[ -f $cand ]] && { BENCH=$cand; break; }; done
T0=$(date +%s)
say() { echo "[gpu_bench_families t+$(( $(date +%s) - T0 ))s] $*"; }
status=0
say "$PRESET at $BUDGETS: $MODEL"
python3 -m bench.decode --model "$MODEL" --make-preset "$PRESET" "${RECIPE[@]}" --budgets "$BUDGETS" --no-profile \
    --no-sampled --new 128 --out "$OUT/$PRESET-decode.json" > "$OUT/$PRESET-decode.log" 2>&1 || status=1
say "decode: exit $status"; tail -n 4 "$OUT/$PRESET-decode.log"
python3 -m bench.prefill --model "$MODEL" --make-preset "$PRESET" "${RECIPE[@]}" --prompts 4096 --budgets "$BUDGETS" \
    --no-profile \
    --out "$OUT/$PRESET-prefill.json" > "$OUT/$PRESET-prefill.log" 2>&1 || status=1
say "prefill: exit $status"; tail -n 4 "$OUT/$PRESET-prefill.log"
rm -f "$OUT/$PRESET-llama.jsonl"
python3 -m bench.llama_bench --model "$MODEL" --bench "$BENCH" --budgets "$BUDGETS" \
    --out "$OUT/$PRESET-llama.jsonl" > "$OUT/$PRESET-llama.log" 2>&1 || status=1
say "llama-bench: exit $status"; tail -n 8 "$OUT/$PRESET-llama.log"
[[ $DIR == /dev/shm ]] && rm -f "$MODEL"
echo "==== $PRESET: Strata beside llama.cpp ===="
python3 -m bench.vs_llama "$OUT/$PRESET-decode.json" "$OUT/$PRESET-prefill.json" "$OUT/$PRESET-llama.jsonl"
exit $status
