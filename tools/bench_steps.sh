# The step helpers of the GPU bench scripts (tools/gpu_bench_families.sh, tools/gpu_bench_qwen4exp.sh), sourced from
# the checkout's root after the script's own arguments are read: `BENCH_SCRIPT=<name>; source tools/bench_steps.sh`.
# Sourcing starts the clock (T0) that say's t+ and left count from; DEADLINE (seconds) must be set.
# BENCH: llama-bench, LLAMA_BENCH (default /tmp/llama-bench), else the first of .lbench/llama-bench.xz,
# .anchors/llama-bench.{xz,gz} carried into the checkout.
BENCH=${LLAMA_BENCH:-/tmp/llama-bench}
for cand in "$BENCH" .lbench/llama-bench.xz .anchors/llama-bench.xz .anchors/llama-bench.gz; do [[ -f $cand ]] && { BENCH=$cand; break; }; done
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$BENCH_SCRIPT t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
min() { echo $(( $1 < $2 ? $1 : $2 )); }
# step NAME LIMIT_S LOG CMD...: the command under `timeout` (its whole process group), its log under $OUT
step() {
    local name=$1 limit=$2 log=$3; shift 3
    if [[ ${DRY_RUN:-0} == 1 ]]; then echo "DRY $name (limit ${limit}s) > $log: $*"; return 0; fi
    if (( limit < 10 )); then say "$name: skipped, ${limit}s left"; return 1; fi
    timeout -k 10 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    (( rc == 124 || rc == 137 )) && say "$name: stopped at its limit of ${limit}s"
    say "$name: exit $rc"; tail -n 6 "$log"
    return $rc
}
# shm_room MB: /dev/shm's free space beside the model's size (MB, tools.make_moe --dry-run's total; empty: it gave
# none) and the RAM available; exits the script (1) unless /dev/shm holds the model with 1000 MB to spare.
shm_room() {
    local need=$1 have
    have=$(( $(df -B1 --output=avail /dev/shm | tail -n 1) / 1000000 ))
    say "/dev/shm: ${have} MB free, the model takes ${need} MB; RAM: $(awk '/MemAvailable/ {printf "%.1f GiB available", $2 / 2^20}' /proc/meminfo)"
    [[ -n $need ]] || { say "tools.make_moe --dry-run gave no size: stopping"; exit 1; }
    if (( have < need + 1000 )); then say "/dev/shm cannot hold the model: stopping"; exit 1; fi
}
