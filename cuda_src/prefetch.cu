// Next-layer expert prefetch for decode (engine/cuda/prefetch.py drives it; pre-gating as in Pre-gated MoE / ProMoE /
// AdapMoE): layer l's router launch (router_predict) also runs layer l+1's router on layer l's FFN input and ranks
// its top-k (`predict` does the same as a launch of its own), and on a side stream `prefetch_copy` pulls the
// predicted experts that have no VRAM cache slot from the mapped pinned arena into VRAM staging slots and points
// layer l+1's table entries at them. The PCIe link then works while layer l's experts
// and layer l+1's attention compute, instead of only inside layer l+1's expert kernels.
//
// Staging: 2 banks (layer parity) of k slots. A bank's record (rec: layer, n, expert ids; rec_addr: the entries'
// original addresses) lets the next user of the bank, two layers on, restore the table first; prefetch_finish
// restores both banks at the end of the step, so the table is clean between steps. At prefetch depth 2 (layer l
// also predicts layer l+2, whose copy starts right away) there are 3 banks (layer m % 3): the copy for layer m,
// launched after layer m-2's router, reuses the bank of layer m-3, whose experts ran before that router; the end of
// the step adds prefetch_restore for the third bank. The kernels do not know the depth: prefetch.py picks the
// pointers (pred of the layer copied, the bank, the stats pair a layer's routing is noted against).
//
// Late misses (CudaOptions.fetch_misses, on by default): after layer l's prefetch copy is joined, the main stream runs
// prefetch_copy once more for layer l with the layer's actual routing as the "prediction", into one of two miss
// banks (layer parity): every routed expert still outside VRAM (neither a cache slot nor a staging or miss slot, the
// second VRAM range [stage_lo, stage_hi) covering all banks; nor 0, file-only) is copied with the whole grid's loads
// in flight (~46 GB/s) instead of being read in place by the expert kernels, whose k-way split leaves one missed
// expert few loads in flight (~15-20 GB/s). Its own counters: `staged` is the fetched counter, `used`
// and `actual` null (a late copy is used by definition).
#include "quant.cuh"
#include "common.cuh"
// route_block (the router's last-block routing), for router_predict below. CuPy's kernel cache keys on this file's
// text, not on what it includes: engine/cuda/prefetch.py passes a digest of router.cu as a define.
#include "router.cu"

#define PF_MAX_EXPERTS 512
#define PF_MAX_K 16
#ifndef PF_LOADS
#define PF_LOADS 8        // 16-byte loads in flight per thread in prefetch_copy
#endif
// stats: look-ups with a prediction, of them predicted right, experts staged (copied over PCIe), staged and used;
// prefetch.py keeps a second (predicted, right) pair at [4], [5] for the depth-2 predictions (note_routing is passed
// stats + 4 for a layer predicted two layers ahead), and at [6] the experts the miss copy fetched late (its staged_ctr)
#define PF_PREDICTED 0
#define PF_CORRECT 1
#define PF_STAGED 2
#define PF_USED 3

// Layer l's routing as the prediction bookkeeping needs it (lanes 0..k-1 of one warp, all 32 lanes call it): ids
// copied to actual (the restore two layers on counts staged experts that were used), and, when the layer had a
// prediction, how many of ids it named. The k look-ups run side by side (the old one-thread loop was k dependent
// L2 round trips).
__device__ __forceinline__ void note_routing(const int* __restrict__ ids, const int* __restrict__ pred, int check,
                                             int* __restrict__ actual, int k, unsigned long long* __restrict__ stats) {
    const int lane = threadIdx.x & 31;
    bool hit = false;
    if (lane < k) {
        const int e = __ldcg(ids + lane);
        actual[lane] = e;
        if (check) {
#pragma unroll
            for (int j = 0; j < PF_MAX_K; ++j)
                if (j < k && __ldcg(pred + j) == e) hit = true;
        }
    }
    const unsigned int n = __popc(__ballot_sync(0xffffffffu, hit));
    if (check && lane == 0) {
        atomicAdd(stats + PF_PREDICTED, (unsigned long long)k);
        atomicAdd(stats + PF_CORRECT, (unsigned long long)n);
    }
}

// Put a bank's rewritten table entries back and count the staged experts its layer used (into *used_ctr; none
// counted when it is null, the miss banks: actual is not read then): one warp (all 32 lanes call it), lane c restores
// the bank's entry c.
__device__ __forceinline__ void restore_bank(unsigned long long* __restrict__ table, int n_expert, int k,
                                             int* __restrict__ rec, const unsigned long long* __restrict__ rec_addr,
                                             const int* __restrict__ actual,
                                             unsigned long long* __restrict__ used_ctr) {
    const int lane = threadIdx.x & 31;
    const int n = __ldcg(rec + 1);
    if (n <= 0) return;                            // the same for every lane
    const int l = __ldcg(rec);
    bool used = false;
    if (lane < n) {
        const int e = __ldcg(rec + 2 + lane);
        table[(long long)l * n_expert + e] = __ldcg(rec_addr + lane);
        if (used_ctr) {
#pragma unroll
            for (int j = 0; j < PF_MAX_K; ++j)
                if (j < k && __ldcg(actual + (long long)l * k + j) == e) used = true;
        }
    }
    const unsigned int u = __popc(__ballot_sync(0xffffffffu, used));
    if (lane == 0) {
        rec[1] = 0;
        if (used_ctr) atomicAdd(used_ctr, (unsigned long long)u);
    }
}

// The k largest of logits[0..n) into out, largest first, ties to the lower id (as the router picks), NaN ranked
// last: every thread of the block ranks its experts against all the others in shared memory, one pass instead of k
// rounds of warp argmax. Ranked on the logits themselves, as router.cu's route_block (exp(logit - max) underflows to
// 0 far below the max and the ranks among those zeros would fall back to ids).
__device__ __forceinline__ void rank_topk(const float* logits, int n, int k, int* __restrict__ out) {
    if (n > RANK_MAX_EXPERTS) {                    // block-uniform: one warp's argmax rounds (router.cu warp_topk)
        if (threadIdx.x < 32) {
            int chosen[ROUTER_MAX_K];
            float chosen_l[ROUTER_MAX_K], mx, s;
            warp_topk(logits, n, k, chosen, chosen_l, mx, s);
#pragma unroll
            for (int j = 0; j < ROUTER_MAX_K; ++j)
                if (j < k && (threadIdx.x & 31) == j) out[j] = chosen[j];
        }
        return;
    }
    __shared__ float4 v4[PF_MAX_EXPERTS / 4];
    float* v = reinterpret_cast<float*>(v4);
    const int n4 = (n + 3) / 4;
    for (int e = threadIdx.x; e < 4 * n4; e += blockDim.x) {
        float l = NEG_INF;                         // padding: after every real expert (ties go to the lower id)
        if (e < n) {
            l = __ldcg(logits + e);
            if (l != l) l = NEG_INF;
        }
        v[e] = l;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        const float ve = v[e];
        const int rank = rank_among(v4, n4, ve, e);
        if (rank < k) out[rank] = e;
    }
}

// Grid ceil(n_expert / warps per block), one warp per router row; dynamic shared memory staged_bytes(n_embd)
// (decode.py; n_embd a multiple of 4, x and norm_w 16-byte aligned).
// logits = R . (rmsnorm(x) * norm_w), the next layer's router on this layer's FFN input (x is the residual before this
// layer's experts add to it; each block normalises it itself, as router_fused does) scaled by the predicted layer's
// FFN norm weights (norm_w: that layer's, as its router will see its own input). The last block writes the top-k
// into pred_out and notes this layer's routing (ids) against the prediction made for it (pred_in) when `check`.
// R == nullptr: the bookkeeping only (a layer with no next router).
// The decode step uses it only where router_predict cannot serve (the two layers' router rows of different types);
// it is router_fused's latency chain: the old version read x twice as scalars, loaded the row only after the staging
// and picked the top-k in k serial warp rounds (17 us a layer on the H200).
//
// The router bias (gpt-oss's ffn_gate_inp.bias, added to the logits before the top-k, as router.cu's
// router_fused_bias) is a compile-time variant: predict_bias / router_predict_bias take the bias pointers as their
// last arguments and instantiate the same bodies with BIAS true. The bias-free kernels keep their code and arguments
// (no load, no branch, no extra parameter), as router.cu keeps router_fused and router_fused_bias apart.
template <int QT, bool BIAS>
__device__ __forceinline__ void predict_body(const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                                             int n_embd, const uint8_t* __restrict__ R, long long row_bytes,
                                             int n_expert, int k, float* __restrict__ logits,
                                             int* __restrict__ pred_out, const int* __restrict__ ids,
                                             const int* __restrict__ pred_in, int check, int* __restrict__ actual,
                                             unsigned long long* __restrict__ stats, int* __restrict__ counter,
                                             const float* __restrict__ bias) {
    if (R) {
        const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
        float s = row_dot<QT>(R, row_bytes, r, n_expert, x, norm_w, eps, n_embd);
        if ((threadIdx.x & 31) == 0 && r < n_expert) {
            if constexpr (BIAS) s += bias[r];
            logits[r] = s;
        }
    }
    if (last_block(counter)) {
        if (threadIdx.x < 32) note_routing(ids, pred_in, check, actual, k, stats);
        if (R) rank_topk(logits, n_expert, k, pred_out);
    }
}

template <int QT>
__global__ void predict(const float* __restrict__ x, const float* __restrict__ norm_w, float eps, int n_embd,
                        const uint8_t* __restrict__ R, long long row_bytes, int n_expert, int k,
                        float* __restrict__ logits, int* __restrict__ pred_out, const int* __restrict__ ids,
                        const int* __restrict__ pred_in, int check, int* __restrict__ actual,
                        unsigned long long* __restrict__ stats, int* __restrict__ counter) {
    predict_body<QT, false>(x, norm_w, eps, n_embd, R, row_bytes, n_expert, k, logits, pred_out, ids, pred_in, check,
                            actual, stats, counter, nullptr);
}

// predict with the predicted layer's router bias (n_expert floats; not read in the bookkeeping mode, R == nullptr).
template <int QT>
__global__ void predict_bias(const float* __restrict__ x, const float* __restrict__ norm_w, float eps, int n_embd,
                             const uint8_t* __restrict__ R, long long row_bytes, int n_expert, int k,
                             float* __restrict__ logits, int* __restrict__ pred_out, const int* __restrict__ ids,
                             const int* __restrict__ pred_in, int check, int* __restrict__ actual,
                             unsigned long long* __restrict__ stats, int* __restrict__ counter,
                             const float* __restrict__ bias) {
    predict_body<QT, true>(x, norm_w, eps, n_embd, R, row_bytes, n_expert, k, logits, pred_out, ids, pred_in, check,
                           actual, stats, counter, bias);
}

// Layer l's router and the prediction of layer l+1's experts in one launch (the decode step's choice when both
// routers' rows have type QT): blocks [0, nb) compute layer l's router logits as router_fused does, blocks
// [nb, 2 nb) layer l+1's router on the same normed x (nb = ceil(n_expert / warps per block)); the last block routes
// layer l (router.cu's route_block: ids, weights, counts, hits), notes that routing against the prediction made
// for it, and ranks the prediction for layer l+1. A separate predict launch sat on the critical path between the
// router and the experts (~9-17 us a layer: a launch, a staging of x, a last-block sync of its own); here the two
// routers' rows load side by side and share one last-block tail. Arguments: router_fused's, then predict's
// (R2: layer l+1's router rows, norm_w2: layer l+1's FFN norm weights, which the blocks [nb, 2 nb) stage x with, as
// predict does; logits2: its logits, pstats: the prefetch counters); counter: this kernel's own. It replaces the
// step's router launch, so its routing must be router_fused's (router_fused_bias's with BIAS) bit for bit: the same
// row_dot at the same block shape (prefetch.py PREDICT_WARPS == launch.py MV_WARPS), the same logit (+ bias) sum,
// the same route_block.
template <int QT, bool BIAS>
__device__ __forceinline__ void router_predict_body(
    const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x, const float* __restrict__ norm_w,
    float eps, int ncols, float* __restrict__ logits, int n_expert, int k, int renorm, float scale,
    int* __restrict__ ids, float* __restrict__ weights, const unsigned long long* __restrict__ table,
    unsigned long long slot_lo, unsigned long long slot_hi, int* __restrict__ counts,
    unsigned long long* __restrict__ stats, const uint8_t* __restrict__ R2, long long row_bytes2,
    const float* __restrict__ norm_w2, float* __restrict__ logits2, int* __restrict__ pred_out,
    const int* __restrict__ pred_in, int check, int* __restrict__ actual, unsigned long long* __restrict__ pstats,
    int* __restrict__ counter, const float* __restrict__ bias, const float* __restrict__ bias2) {
    const int nb = gridDim.x / 2;
    const bool next = blockIdx.x >= nb;
    const int r = (blockIdx.x - (next ? nb : 0)) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    float s = row_dot<QT>(next ? R2 : W, next ? row_bytes2 : row_bytes, r, n_expert, x, next ? norm_w2 : norm_w, eps,
                          ncols);
    if ((threadIdx.x & 31) == 0 && r < n_expert) {
        if constexpr (BIAS) s += (next ? bias2 : bias)[r];
        (next ? logits2 : logits)[r] = s;
    }
    if (last_block(counter)) {
        route_block(logits, n_expert, k, renorm, scale, ids, weights, table, slot_lo, slot_hi, counts, stats);
        __syncthreads();                           // ids written (by threads 0..k-1) before the note reads them
        if (threadIdx.x < 32) note_routing(ids, pred_in, check, actual, k, pstats);
        rank_topk(logits2, n_expert, k, pred_out);
    }
}

template <int QT>
__global__ void router_predict(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                               const float* __restrict__ norm_w, float eps, int ncols, float* __restrict__ logits,
                               int n_expert, int k, int renorm, float scale, int* __restrict__ ids,
                               float* __restrict__ weights, const unsigned long long* __restrict__ table,
                               unsigned long long slot_lo, unsigned long long slot_hi, int* __restrict__ counts,
                               unsigned long long* __restrict__ stats, const uint8_t* __restrict__ R2,
                               long long row_bytes2, const float* __restrict__ norm_w2,
                               float* __restrict__ logits2, int* __restrict__ pred_out,
                               const int* __restrict__ pred_in, int check, int* __restrict__ actual,
                               unsigned long long* __restrict__ pstats, int* __restrict__ counter) {
    router_predict_body<QT, false>(W, row_bytes, x, norm_w, eps, ncols, logits, n_expert, k, renorm, scale, ids,
                                   weights, table, slot_lo, slot_hi, counts, stats, R2, row_bytes2, norm_w2, logits2,
                                   pred_out, pred_in, check, actual, pstats, counter, nullptr, nullptr);
}

// router_predict for gpt-oss: bias (layer l's router bias) and bias2 (layer l+1's), n_expert floats each, added to
// their logits before the top-k; the routing half is then router_fused_bias's (renorm 1: the softmax over the chosen).
template <int QT>
__global__ void router_predict_bias(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                                    const float* __restrict__ norm_w, float eps, int ncols,
                                    float* __restrict__ logits, int n_expert, int k, int renorm, float scale,
                                    int* __restrict__ ids, float* __restrict__ weights,
                                    const unsigned long long* __restrict__ table, unsigned long long slot_lo,
                                    unsigned long long slot_hi, int* __restrict__ counts,
                                    unsigned long long* __restrict__ stats, const uint8_t* __restrict__ R2,
                                    long long row_bytes2, const float* __restrict__ norm_w2,
                                    float* __restrict__ logits2, int* __restrict__ pred_out,
                                    const int* __restrict__ pred_in, int check, int* __restrict__ actual,
                                    unsigned long long* __restrict__ pstats, int* __restrict__ counter,
                                    const float* __restrict__ bias, const float* __restrict__ bias2) {
    router_predict_body<QT, true>(W, row_bytes, x, norm_w, eps, ncols, logits, n_expert, k, renorm, scale, ids,
                                  weights, table, slot_lo, slot_hi, counts, stats, R2, row_bytes2, norm_w2, logits2,
                                  pred_out, pred_in, check, actual, pstats, counter, bias, bias2);
}

// Side stream, launched right after the prediction (router_predict or predict), so the link starts on layer l+1's
// experts while layer l's experts and layer l+1's attention compute; and as the miss copy on the main stream, with
// the routing as `pred`, before a layer's experts (top of the file). For layer `layer` (this bank):
//  - every block's first warp compacts the prediction: lane j looks up predicted expert j's entry, and the experts
//    whose entry is neither a VRAM cache slot (inside [slot_lo, slot_hi)), nor a staging or miss slot (inside
//    [stage_lo, stage_hi): staged earlier in the step, which only the miss copy meets), nor 0 (only in the file,
//    memory modes) get staging slots 0, 1, ... in prediction order (a ballot; one round trip, where one thread used
//    to walk the k entries serially in every block). Nothing else writes this layer's entries while it runs, so
//    every block sees the same plan;
//  - block 0's last warp meanwhile restores the entries the bank's previous layer rewrote (its experts finished
//    before this layer's prediction was made);
//  - all threads then copy the concatenated blobs (n x units 16-byte units) as one range: warp w of the grid takes
//    32 x PF_LOADS consecutive units a round (4 KiB contiguous: each load instruction is 512 coalesced bytes),
//    all PF_LOADS loads issued before any store, so the blocks are not parked on a few experts while others exit
//    and the unit count, not the expert count, sets the work per thread;
//  - the last block points the entries at the staging slots, records them (lane c: entry c) and adds their count to
//    *staged_ctr (the prefetch's staged counter, or the miss copy's fetched one); the restore counts into *used_ctr
//    (null for the miss copy).
// Any grid and any block size that is a multiple of 32 works (the tests use small ones); prefetch.py's choice is
// explained at COPY_BLOCKS.
extern "C" __global__ void prefetch_copy(unsigned long long* __restrict__ table, int layer, int n_expert, int k,
                                         const int* __restrict__ pred, uint8_t* __restrict__ staging, long long stride,
                                         unsigned int units, unsigned long long slot_lo, unsigned long long slot_hi,
                                         unsigned long long stage_lo, unsigned long long stage_hi,
                                         int* __restrict__ rec, unsigned long long* __restrict__ rec_addr,
                                         const int* __restrict__ actual, unsigned long long* __restrict__ staged_ctr,
                                         unsigned long long* __restrict__ used_ctr, int* __restrict__ counter) {
    __shared__ unsigned long long src[PF_MAX_K];
    __shared__ int who[PF_MAX_K];
    __shared__ int n_sh;
    unsigned long long* row = table + (long long)layer * n_expert;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (warp == 0) {
        int e = 0;
        unsigned long long a = 0;
        if (lane < k) {
            e = __ldcg(pred + lane);
            a = __ldcg(row + e);
        }
        const bool need = lane < k && a && (a < slot_lo || a >= slot_hi) && (a < stage_lo || a >= stage_hi);
        const unsigned int m = __ballot_sync(0xffffffffu, need);
        if (need) {
            const int c = __popc(m & ((1u << lane) - 1u));
            src[c] = a;
            who[c] = e;
        }
        if (lane == 0) n_sh = __popc(m);
    }
    if (blockIdx.x == 0 && warp == nwarps - 1) restore_bank(table, n_expert, k, rec, rec_addr, actual, used_ctr);
    __syncthreads();
    const unsigned int n = n_sh;
    const unsigned int total = n * units;
    const unsigned int gwarp = blockIdx.x * nwarps + warp, gwarps = gridDim.x * nwarps;
    const unsigned int chunk = 32u * PF_LOADS;
    for (unsigned int base = gwarp * chunk + lane; base < total; base += gwarps * chunk) {
        uint4 v[PF_LOADS];
#pragma unroll
        for (int i = 0; i < PF_LOADS; ++i) {
            const unsigned int u = base + 32u * i;
            if (u < total) {
                const unsigned int c = u / units;
                // streaming: these host bytes are read once; the staged copy is what layer l+1 reads (from L2, if
                // it is still there)
                v[i] = __ldcs(reinterpret_cast<const uint4*>(src[c]) + (u - c * units));
            }
        }
#pragma unroll
        for (int i = 0; i < PF_LOADS; ++i) {
            const unsigned int u = base + 32u * i;
            if (u < total) {
                const unsigned int c = u / units;
                reinterpret_cast<uint4*>(staging + (long long)c * stride)[u - c * units] = v[i];
            }
        }
    }
    if (last_block(counter)) {
        const int c = threadIdx.x;
        if (c < (int)n) {
            rec[2 + c] = who[c];
            rec_addr[c] = src[c];
            row[who[c]] = (unsigned long long)(staging + (long long)c * stride);
        }
        if (c == 0) {
            rec[0] = layer;
            rec[1] = n;
            if (n) atomicAdd(staged_ctr, (unsigned long long)n);
        }
        __threadfence();
    }
}

// Consecutive banks' restores, one warp each (one block of 32 x banks threads; bank b's record at rec + b (2 + k),
// rec_addr + b k): the end of a depth-2 step restores its third bank with it, after prefetch_finish (whose note there
// runs with check 0: at depth 2 the last layer's routing is noted by predict in bookkeeping mode, against the depth-2
// counters), and the end of a step with late misses the two miss banks (used_ctr null). A bank whose record is empty
// (n == 0) is left alone.
extern "C" __global__ void prefetch_restore(unsigned long long* __restrict__ table, int n_expert, int k,
                                            int* __restrict__ rec, const unsigned long long* __restrict__ rec_addr,
                                            const int* __restrict__ actual, unsigned long long* __restrict__ used_ctr) {
    const int b = threadIdx.x >> 5;
    restore_bank(table, n_expert, k, rec + (long long)b * (2 + k), rec_addr + (long long)b * k, actual, used_ctr);
    __threadfence();
}

// End of the step (one warp, after the last layer's experts): the last layer's routing noted as predict does for the
// others, then both banks restored.
extern "C" __global__ void prefetch_finish(unsigned long long* __restrict__ table, int n_expert, int k,
                                           const int* __restrict__ ids, const int* __restrict__ pred, int check,
                                           int last_layer, int* __restrict__ actual, int* __restrict__ rec0,
                                           const unsigned long long* __restrict__ rec_addr0, int* __restrict__ rec1,
                                           const unsigned long long* __restrict__ rec_addr1,
                                           unsigned long long* __restrict__ stats) {
    note_routing(ids, pred, check, actual + (long long)last_layer * k, k, stats);
    __syncwarp();      // the last layer's routing (actual) written before the restores count against it
    restore_bank(table, n_expert, k, rec0, rec_addr0, actual, stats + PF_USED);
    restore_bank(table, n_expert, k, rec1, rec_addr1, actual, stats + PF_USED);
    __threadfence();
}
