// Greedy sampling on the GPU: the argmax of the logits as one 64-bit word per step (sortable value bits high,
// inverted index low, so ties pick the lowest id as numpy's argmax does), then the id goes to mapped host memory.
#include "common.cuh"

__device__ __forceinline__ unsigned int sortable(float v) {
    const unsigned int b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Grid-stride over n logits; state[2..3] holds the running word (cleared by the step's embed kernel),
// state[4] counts NaNs.
extern "C" __global__ void argmax_word(const float* __restrict__ logits, int n, int* __restrict__ state) {
    unsigned long long best = 0ull;
    int nan = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = logits[i];
        if (v != v) { nan = 1; continue; }
        const unsigned long long w = ((unsigned long long)sortable(v) << 32) | (0xffffffffu - (unsigned int)i);
        best = w > best ? w : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long ob = __shfl_xor_sync(0xffffffffu, best, o);
        best = ob > best ? ob : best;
        nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(reinterpret_cast<unsigned long long*>(state + 2), best);
        if (nan) atomicAdd(state + 4, 1);
    }
}

// One thread: out[0] = chosen id, out[1] = NaN count (the step's pick buffer, or mapped pinned memory).
extern "C" __global__ void argmax_finish(const int* __restrict__ state, int* __restrict__ out_host) {
    const unsigned long long w = reinterpret_cast<const unsigned long long*>(state + 2)[0];
    out_host[0] = (int)(0xffffffffu - (unsigned int)(w & 0xffffffffull));
    out_host[1] = state[4];
}

// One thread, a decode step's last launch (engine/cuda/decode.py): the step at position pos = state[1] publishes its
// pick (id, status) in slot pos % n_slots of the mapped pick ring, which the host reads after the step's event, and
// in `out` (mapped: the last step's pick, read after a whole-stream wait), and makes it the next step's input:
// params = (id, pos + 1), so the next step can be launched before the host has read this one (the pipeline,
// engine/cuda/backend.py). A failed pick (status != 0, or an id outside the vocabulary) feeds token 0: the host
// discards a step launched after it. Idempotent within a step (it reads pos from state, which only the embed kernel
// writes), so a second pick after the first (the paged modes' sampled pick after the greedy parts) may publish again.
extern "C" __global__ void step_advance(const int* __restrict__ state, const int* __restrict__ pick,
                                        int* __restrict__ params, int* __restrict__ ring, int* __restrict__ out,
                                        int n_slots, int n_vocab) {
    const int pos = state[1];
    const int id = pick[0], status = pick[1];
    int* slot = ring + 2 * (pos % n_slots);
    slot[0] = id;
    slot[1] = status;
    out[0] = id;
    out[1] = status;
    params[P_TOKEN] = (status == 0 && id >= 0 && id < n_vocab) ? id : 0;
    params[P_POS] = pos + 1;
}

// ================================================================================================================
// Sampled picks (engine/cuda/sampler.py drives these; engine/sampling.py is the reference semantics):
// penalties -> top_k -> top_p -> min_p (all on the untempered distribution) -> temperature -> one draw.
//
// Every setting that changes between requests or steps is read from SampleParams / SampleState in device memory,
// never from kernel arguments, so the launches sit in a CUDA graph captured once and replayed (docs/design.md "Decode"). Kernel
// arguments are only what is fixed for the graph's life (buffer addresses, the vocabulary size).
//
// The kept set is always a prefix of the vocabulary sorted by (logit descending, id ascending): top_k, top_p and
// min_p each cut that order, so the final set is {key > bkey} plus the first m ids (in id order) with key == bkey,
// where key is the logit's sortable bits. sample_select finds (bkey, m) by a radix select over the key (11+11+10
// bits) with counts and masses per bucket, never sorting the vocabulary. Bucket masses come from shared-memory
// float atomics (fast, order-dependent), so the chosen bucket is then checked with exact double sums in a fixed
// order and moved if rounding misplaced it: the result is exact and the same on every run. The draw is an inverse
// CDF over the kept ids in id order, with u = uniform(seed, step) from a counter-based hash (splitmix64), so a
// seeded request reproduces on the same build and the tests can redo the draw in NumPy with the same u.
// ================================================================================================================

struct SampleParams {                 // engine/cuda/sampler.py PARAMS_DTYPE mirrors this layout (56 bytes)
    double top_p;                     // >= 1: off
    double log_min_p;                 // -inf: off
    unsigned long long seed;
    float temp;                       // <= 0: greedy (the argmax of the penalized logits)
    float pen_repeat, pen_freq, pen_present;
    int top_k;                        // <= 0 or >= n: off
    int penalties;                    // 1: apply the window's counts
    int window;                       // ring length of the penalty window (0: no window kept)
    int pad;
};

// Which filters are on: the one statement of their "off" values above, for every kernel that branches on them
// (sample_prep's histogram, sample_cut, sample_exp's and sample_select's min_p floor, sample_select's paths).
__device__ __forceinline__ bool top_k_on(const SampleParams& p, int n) { return p.top_k > 0 && p.top_k < n; }
__device__ __forceinline__ bool top_p_on(const SampleParams& p) { return p.top_p < 1.0; }
__device__ __forceinline__ bool min_p_on(const SampleParams& p) { return p.log_min_p > -1e300; }
// A filter cuts the kept set (temperature alone keeps every key): sample_cut's cases.
__device__ __forceinline__ bool filters_on(const SampleParams& p, int n) {
    return top_k_on(p, n) || top_p_on(p) || min_p_on(p);
}

struct SampleState {                  // engine/cuda/sampler.py STATE_DTYPE mirrors this layout (72 bytes)
    unsigned long long maxword;       // argmax word of the penalized logits (cleared each step)
    int nan;                          // NaN logits seen this step (cleared each step)
    unsigned int cut;                 // sample_cut: the candidates are the keys >= cut (cleared each step)
    unsigned long long step;          // draws so far: the RNG counter
    int ring_head, ring_len;          // the penalty window's ring
    double u;                         // what the last draw used (tests read these)
    double total;                     // tempered mass of the kept set
    double zk;                        // untempered mass the top_p target is relative to
    unsigned int bkey;                // the kept set: key > bkey, or key == bkey among the first m such ids
    int m;
    int pick;
    int nc;                           // candidates: sample_cut 0 (gather them) or -1 (the whole vocabulary);
                                      // sample_select then how many it selected from, or -1
};

#define SEL_THREADS 1024
#define SEL_WARPS (SEL_THREADS / 32)
#define ALL_TIES 0x7fffffff
#define FULL_MASK 0xffffffffu
#define SAMPLE_GRID 264
#define SAMPLE_THREADS 256            // sample_prep / sample_exp / sample_gather blocks
// The count histogram sample_prep builds for sample_cut: a bin is the key's top 12 bits (sign, exponent, 3 mantissa
// bits), so one bin holds values within 12.5% of each other and the sparse top of a logit distribution spreads over
// many bins.
#define HIST_SHIFT 20
#define HIST_BINS 4096
#define CUT_THREADS 1024
// Candidates sample_select copies into shared memory (dynamic: 32 KB, opted in beside its 17 KB of static shared
// memory; fits every card from sm_75 on) and selects from instead of the vocabulary. On SmolLM2-135M's logits along
// sampled continuations (366 steps), top_p 0.95 alone kept more than 4096 ids at 2 steps, and the cut's bound left
// more than 4096 candidates at 27; more than 8192 at none (top_p 0.99: 56 / 90 over 4096, 22 / 48 over 8192).
#define CAND_CAP 8192

// The sort key of a logit, with -0 folded into +0 (they compare equal, so they must tie, as on the host).
__device__ __forceinline__ unsigned int skey(float v) { return sortable(v + 0.0f); }

__device__ __forceinline__ float key_value(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// splitmix64 of (seed, step): engine/cuda/sampler.py uniform() is the same function in Python.
__device__ __forceinline__ double rng_uniform(unsigned long long seed, unsigned long long step) {
    unsigned long long z = seed + (step + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// The total untempered mass from sample_exp's block sums, in one fixed order, so that sample_cut and sample_select
// get the same bits: lane-strided, then the butterfly (every lane the same sum: a + b == b + a).
__device__ __forceinline__ double zpart_sum(const double* __restrict__ zpart, int nz) {
    double z = 0.0;
    for (int b = threadIdx.x & 31; b < nz; b += 32) z += zpart[b];
    return warp_sum_d(z);
}

// In place, by one thread: a[w] becomes the sum of a[0..w) (the warps' offsets from their counts); returns the total.
__device__ __forceinline__ int exclusive_offsets(int* a, int n) {
    int acc = 0;
    for (int w = 0; w < n; ++w) {
        const int t = a[w];
        a[w] = acc;
        acc += t;
    }
    return acc;
}

// Fixed-order block sums (every thread gets the result): the same bits on every run.
__device__ double block_sum_d(double v, double* buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) t += buf[i];
    return t;
}

__device__ long long block_sum_ll(long long v, long long* buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    long long t = 0;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) t += buf[i];
    return t;
}

// 1. Penalties (engine/sampling.py apply_penalties, the same float32 operations, no FMA contraction) into work,
//    the argmax word of the result and the NaN count into the state, and (sampled picks that sample_cut serves)
//    each non-NaN key's count in its histogram bin (hist, cleared each step): counted in shared memory, then one
//    global atomic per bin the block saw. Grid-stride, any grid of SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_prep(const float* __restrict__ logits, int n, const SampleParams* __restrict__ P,
            const int* __restrict__ counts, float* __restrict__ work, SampleState* __restrict__ S,
            int* __restrict__ hist) {
    __shared__ int sh_hist[HIST_BINS];
    const int pen = P->penalties;
    // sample_cut's cases: a sampled pick with top_k, top_p or min_p (temperature alone keeps every key)
    const bool want_hist = P->temp > 0.f && filters_on(*P, n);
    const float rep = P->pen_repeat, freq = P->pen_freq, pres = P->pen_present;
    if (want_hist) {
        for (int b = threadIdx.x; b < HIST_BINS; b += blockDim.x) sh_hist[b] = 0;
        __syncthreads();
    }
    unsigned long long best = 0ull;
    int nan = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = logits[i];
        if (pen) {
            const int c = counts[i];
            if (c > 0) {
                v = v <= 0.f ? __fmul_rn(v, rep) : __fdiv_rn(v, rep);
                v = __fsub_rn(__fsub_rn(v, __fmul_rn((float)c, freq)), pres);
            }
        }
        work[i] = v;
        if (v != v) { nan = 1; continue; }
        const unsigned int k = skey(v);
        const unsigned long long w = ((unsigned long long)k << 32) | (0xffffffffu - (unsigned int)i);
        best = w > best ? w : best;
        if (want_hist) atomicAdd(&sh_hist[k >> HIST_SHIFT], 1);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long ob = __shfl_xor_sync(FULL_MASK, best, o);
        best = ob > best ? ob : best;
        nan |= __shfl_xor_sync(FULL_MASK, nan, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&S->maxword, best);
        if (nan) atomicAdd(&S->nan, 1);
    }
    if (want_hist) {
        __syncthreads();
        for (int b = threadIdx.x; b < HIST_BINS; b += blockDim.x) {
            const int c = sh_hist[b];
            if (c) atomicAdd(&hist[b], c);
        }
    }
}

// The min_p floor: keep v >= vmax + log(min_p), compared in float64 (0: off). Never above the top key: min_p > 1
// would keep nothing, so it keeps the top.
__device__ __forceinline__ unsigned int min_p_floor(const SampleParams& p, float vmax, unsigned int kmax) {
    if (!min_p_on(p)) return 0u;
    const unsigned int f = skey(__double2float_ru((double)vmax + p.log_min_p));
    return f > kmax ? kmax : f;
}

// 2. Per token, relative to the maximum: pw = exp(v - vmax) (untempered, what top_p measures) and
//    qw = exp(v/T - vmax/T) (the draw's weights), each exactly as engine/sampling.py computes them (the difference
//    in float32, the exp in float64); zpart[block] = this block's sum of pw in a fixed order. Block b covers the ids
//    [b chunk, b chunk + chunk), chunk = ceil(n / grid), so that qpart[b], its sum of qw over the keys at or above the
//    min_p floor, is the tempered mass of one run of ids: when no top_k or top_p cuts the kept set, sample_select
//    finds the run the draw falls in from these sums and walks only that run, instead of a pass over the vocabulary
//    (bench.sampler, temperature alone: sample_select 76 -> 11 us). Grid: SAMPLE_GRID x 256.
extern "C" __global__ void sample_exp(const float* __restrict__ work, int n, const SampleParams* __restrict__ P,
                                      const SampleState* __restrict__ S, double* __restrict__ pw,
                                      double* __restrict__ qw, double* __restrict__ zpart,
                                      double* __restrict__ qpart) {
    __shared__ double buf[32];
    const SampleParams p = *P;
    const float temp = p.temp;
    if (temp <= 0.f || S->nan) return;          // greedy needs neither; NaN: the step fails
    const unsigned int kmax = (unsigned int)(S->maxword >> 32);
    const float vmax = key_value(kmax);
    const float tmax = __fdiv_rn(vmax, temp);
    const unsigned int floor = min_p_floor(p, vmax, kmax);
    const int chunk = (n + gridDim.x - 1) / gridDim.x;
    const int i0 = blockIdx.x * chunk, i1 = min(n, i0 + chunk);
    double z = 0.0, q = 0.0;
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        const float v = work[i];
        const double pv = exp((double)__fsub_rn(v, vmax));
        const double qv = exp((double)__fsub_rn(__fdiv_rn(v, temp), tmax));
        pw[i] = pv;
        qw[i] = qv;
        z += pv;
        if (skey(v) >= floor) q += qv;
    }
    z = block_sum_d(z, buf);
    q = block_sum_d(q, buf);
    if (threadIdx.x == 0) {
        zpart[blockIdx.x] = z;
        qpart[blockIdx.x] = q;
    }
}

// 3. One block: the candidates, a set of keys >= cut that surely holds the kept set, so that sample_select works on
//    them instead of the vocabulary (where a pick with top_k or top_p took 0.5-0.64 ms in bench.sampler). From the
//    histogram alone, per bin b (lo_b and hi_b its lowest and highest values):
//    - top_k on: the highest non-empty bin whose suffix count (bins >= b) reaches K: the top K keys are >= lo_b;
//    - top_p alone: the highest non-empty bin from which the kept prefix surely reaches top_p x Z: either the
//      suffix's mass bounded below (count x exp(lo_b - vmax), each key's pw at least that) reaches it, or Z less the
//      mass below the bin bounded above (count x exp(hi_b - vmax), at most 1) does. The first is tight at the top
//      of a distribution, the second when the bulk below holds little mass (a bin spans 12.5% of its values, so
//      either bound alone is off by a factor of e^(v/8)). A 1e-9 margin covers the double sums' rounding (~1e-15);
//    - neither: the min_p floor (0 without it: every key, so no candidates);
//    and never below the min_p floor, except with top_k and top_p together: top_p measures its mass within the
//    top_k survivors, min_p's floor or not, so all of them must be candidates (a floor above the K-th key left
//    fewer than K, and the mass of the missing ones unknown). nc = 0 when the bins at and above the cut hold at most
//    CAND_CAP keys, else -1
//    (sample_select then works on the whole vocabulary, as without candidates).
extern "C" __global__ void __launch_bounds__(CUT_THREADS)
sample_cut(const int* __restrict__ hist, const double* __restrict__ zpart, int nzpart, int n,
           const SampleParams* __restrict__ P, SampleState* __restrict__ S) {
    constexpr int PER = HIST_BINS / CUT_THREADS;      // thread t: bins [PER t, PER t + PER)
    constexpr int WARPS = CUT_THREADS / 32;
    __shared__ long long s_wc[WARPS];
    __shared__ double s_wl[WARPS], s_wu[WARPS];
    __shared__ double s_z;
    __shared__ int s_best;
    __shared__ long long s_bound;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const SampleParams p = *P;
    const unsigned int kmax = (unsigned int)(S->maxword >> 32);
    const bool k_on = top_k_on(p, n), p_on = top_p_on(p);
    if (p.temp <= 0.f || S->nan || kmax == skey(NEG_INF) || !filters_on(p, n)) {
        if (tid == 0) S->nc = -1;                      // greedy, a failing pick, or every key kept
        return;
    }
    const float vmax = key_value(kmax);
    const unsigned int floor = min_p_floor(p, vmax, kmax);
    const bool by_mass = !k_on && p_on;
    if (warp == 0) {
        const double z = zpart_sum(zpart, nzpart);
        if (tid == 0) { s_z = z; s_best = -1; }
    }
    int c[PER];
    double lb[PER], ub[PER];
    long long tc = 0;
    double tl = 0.0, tu = 0.0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int b = tid * PER + j;
        c[j] = hist[b];
        lb[j] = ub[j] = 0.0;
        if (by_mass && c[j] > 0) {
            const float lo = key_value((unsigned int)b << HIST_SHIFT);
            const float hi = key_value((((unsigned int)b + 1u) << HIST_SHIFT) - 1u);
            if (lo == lo) lb[j] = (double)c[j] * exp((double)__fsub_rn(lo, vmax));   // NaN patterns: bound 0
            ub[j] = (double)c[j] * (hi == hi ? fmin(1.0, exp((double)__fsub_rn(hi, vmax))) : 1.0);
        }
        tc += c[j];
        tl += lb[j];
        tu += ub[j];
    }
    // counts and lower bounds summed from the top (suffixes), upper bounds from the bottom (prefixes): within the warp
    // by shuffles, then over the warps
    long long sc = tc;
    double sl = tl, pu = tu;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const long long xc = __shfl_down_sync(FULL_MASK, sc, o);
        const double xl = __shfl_down_sync(FULL_MASK, sl, o);
        const double xu = __shfl_up_sync(FULL_MASK, pu, o);
        if (lane + o < 32) { sc += xc; sl += xl; }
        if (lane >= o) pu += xu;
    }
    if (lane == 0) { s_wc[warp] = sc; s_wl[warp] = sl; }
    if (lane == 31) s_wu[warp] = pu;
    __syncthreads();
    for (int w = warp + 1; w < WARPS; ++w) { sc += s_wc[w]; sl += s_wl[w]; }
    for (int w = 0; w < warp; ++w) pu += s_wu[w];
    sc -= tc;                                          // bins above this thread's
    sl -= tl;
    pu -= tu;                                          // bins below this thread's
    const long long K = k_on ? (long long)p.top_k : 0;
    const double z = s_z;
    const double target = p.top_p * z * (1.0 + 1e-9);
    double below[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) { below[j] = pu; pu += ub[j]; }
    long long suf_c[PER];
#pragma unroll
    for (int j = PER - 1; j >= 0; --j) {
        sc += c[j];
        sl += lb[j];
        suf_c[j] = sc;
        const bool reach = k_on ? sc >= K : (p_on && (sl >= target || z - below[j] >= target));
        if (c[j] > 0 && reach) atomicMax(&s_best, tid * PER + j);
    }
    __syncthreads();
    unsigned int cut = s_best >= 0 ? (unsigned int)s_best << HIST_SHIFT : 0u;
    if (cut < floor && !(k_on && p_on)) cut = floor;
    const int cb = (int)(cut >> HIST_SHIFT);
    if (cb / PER == tid) s_bound = suf_c[cb % PER];
    __syncthreads();
    if (tid == 0) {
        S->cut = cut;
        S->nc = s_bound <= CAND_CAP ? 0 : -1;
    }
}

// 4. The candidates as a bitmap, bit i of word i/32: key(work[i]) >= cut (nothing when sample_cut found none). Any
//    grid of whole warps; every word is written, so the bitmap needs no clearing.
extern "C" __global__ void sample_gather(const float* __restrict__ work, int n, const SampleState* __restrict__ S,
                                         unsigned int* __restrict__ bitmap) {
    if (S->nc < 0) return;
    const unsigned int cut = S->cut;
    const int lane = threadIdx.x & 31;
    const int nwords = (n + 31) >> 5;
    const int wstride = (gridDim.x * blockDim.x) >> 5;
    for (int w = (blockIdx.x * blockDim.x + (int)threadIdx.x) >> 5; w < nwords; w += wstride) {
        const int i = (w << 5) + lane;
        const unsigned int bits = __ballot_sync(FULL_MASK, i < n && skey(work[i]) >= cut);
        if (lane == 0) bitmap[w] = bits;
    }
}

struct SelShared {
    unsigned int prefix;              // key bits fixed by the levels so far
    int bstar;                        // this level's bucket (-1: none triggers)
    long long ca;                     // tokens above the current range (exact)
    double ma;                        // their untempered mass (exact)
    int all;                          // no condition triggered: keep every key >= floor
    int go;                           // the bucket check's loop flag
    int up, down;                     // the bucket check's nearest non-empty buckets above and below
};

// Radix select of the prefix: the first position (in the sorted order, keys >= floor only) where the count reaches
// K or the mass reaches target. Leaves (bkey, m) in *out_bkey / *out_m (m = ALL_TIES: every tie at bkey) and the
// count / exact mass above bkey in sh. Whole block; use_mass = 0 makes it count-only (exact without checks). Over
// the ids ids[0..n) (the candidates, ascending), or 0..n when ids is null: the candidates hold every key >= the
// boundary, and the counts and masses from the top down to it are the same over them as over the vocabulary.
__device__ void select_prefix(const float* __restrict__ work, const double* __restrict__ pw, const int* ids, int n,
                              long long K,
                              double target, unsigned int floor, int use_mass, float vmax, int* hc, float* hm,
                              SelShared& sh,
                              double* dbuf, long long* lbuf, unsigned int* out_bkey, int* out_m) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) { sh.prefix = 0u; sh.ca = 0; sh.ma = 0.0; sh.all = 0; }
    __syncthreads();
    for (int lv = 0; lv < 3; ++lv) {
        const int shift = lv == 0 ? 21 : (lv == 1 ? 10 : 0);
        const int bits = lv == 2 ? 10 : 11;
        const int nb = 1 << bits;
        const int ps = shift + bits;                  // the parent's shift (32 at the top: no parent)
        const unsigned int prefix = sh.prefix;
        for (int b = tid; b < nb; b += blockDim.x) { hc[b] = 0; hm[b] = 0.f; }
        __syncthreads();
        for (int j = tid; j < n; j += blockDim.x) {
            const int i = ids ? ids[j] : j;
            const unsigned int k = skey(work[i]);
            if (k < floor || (ps < 32 && (k >> ps) != prefix)) continue;
            const int b = (int)((k >> shift) & (unsigned int)(nb - 1));
            atomicAdd(&hc[b], 1);
            if (use_mass) atomicAdd(&hm[b], (float)pw[i]);
        }
        __syncthreads();
        // The first bucket from the top where the count (or the mass) reaches: suffix sums over the buckets, block-
        // wide (thread t holds buckets [per t, per t + per)), and the highest bucket that reaches, instead of warp 0
        // walking down 32 buckets at a time (up to 64 rounds of shuffles a level).
        const int per = (nb + (int)blockDim.x - 1) / (int)blockDim.x;
        long long tcnt = 0;
        double tmass = 0.0;
        for (int j = 0; j < per; ++j) {
            const int b = tid * per + j;
            if (b < nb) {
                tcnt += hc[b];
                if (use_mass) tmass += (double)hm[b];
            }
        }
        long long sc = tcnt;
        double sm = tmass;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const long long xc = __shfl_down_sync(FULL_MASK, sc, o);
            const double xm = __shfl_down_sync(FULL_MASK, sm, o);
            if (lane + o < 32) { sc += xc; sm += xm; }
        }
        const long long nc_ = __shfl_down_sync(FULL_MASK, sc, 1);
        const double nm_ = __shfl_down_sync(FULL_MASK, sm, 1);
        long long ca = lane < 31 ? nc_ : 0;           // this warp's buckets above this thread's
        double ma = lane < 31 ? nm_ : 0.0;
        if (lane == 0) { lbuf[warp] = sc; dbuf[warp] = sm; }
        if (tid == 0) sh.bstar = -1;
        __syncthreads();
        for (int w = warp + 1; w < (int)(blockDim.x >> 5); ++w) { ca += lbuf[w]; ma += dbuf[w]; }
        ca += sh.ca;                                  // and the levels' before
        ma += sh.ma;
        const long long ca0 = ca;
        for (int j = per - 1; j >= 0; --j) {
            const int b = tid * per + j;
            if (b >= nb) continue;
            const int c = hc[b];
            ca += c;
            if (use_mass) ma += (double)hm[b];
            if (c > 0 && (ca >= K || (use_mass && ma >= target))) atomicMax(&sh.bstar, b);
        }
        __syncthreads();
        if (!use_mass && sh.bstar >= 0 && sh.bstar / per == tid) {     // the count above the bucket found
            long long above = ca0;
            for (int b = tid * per + per - 1; b > sh.bstar; --b)
                if (b < nb) above += hc[b];
            sh.ca = above;
        }
        __syncthreads();
        if (use_mass) {
            // Check the bucket with exact sums; move it while rounding put it on the wrong side. (The searches for
            // the nearest non-empty buckets run over the whole block, not one thread walking 2048 counters.)
            if (tid == 0) { sh.go = 1; sh.up = nb; }
            __syncthreads();
            if (sh.bstar < 0) {                       // start from the lowest non-empty bucket
                for (int bb = tid; bb < nb; bb += blockDim.x)
                    if (hc[bb] > 0) atomicMin(&sh.up, bb);
                __syncthreads();
                if (tid == 0) {
                    sh.bstar = sh.up < nb ? sh.up : -1;
                    if (sh.bstar < 0) sh.go = 0;
                }
            }
            __syncthreads();
            int tried = 0;
            while (sh.go) {
                const int b = sh.bstar;
                const unsigned int lo = ((prefix << bits) | (unsigned int)b) << shift;
                const unsigned int hi = lo | ((1u << shift) - 1u);
                const unsigned int lo_f = lo > floor ? lo : floor;
                double above = 0.0, in = 0.0;
                for (int j = tid; j < n; j += blockDim.x) {
                    const int i = ids ? ids[j] : j;
                    const unsigned int k = skey(work[i]);
                    if (k > hi && k >= floor) above += pw[i];
                    else if (k >= lo_f && k <= hi) in += pw[i];
                }
                long long cabove = 0;
                for (int bb = b + 1 + tid; bb < nb; bb += blockDim.x) cabove += hc[bb];
                if (tid == 0) { sh.up = nb; sh.down = -1; }
                above = block_sum_d(above, dbuf);
                in = block_sum_d(in, dbuf);
                cabove = block_sum_ll(cabove, lbuf) + sh.ca;
                for (int bb = tid; bb < nb; bb += blockDim.x) {
                    if (hc[bb] > 0 && bb > b) atomicMin(&sh.up, bb);
                    if (hc[bb] > 0 && bb < b) atomicMax(&sh.down, bb);
                }
                __syncthreads();
                if (tid == 0) {
                    const bool c_above = cabove >= K || above >= target;
                    const bool c_in = cabove + hc[b] >= K || above + in >= target;
                    const int up = sh.up, down = sh.down;
                    // monotone conditions: moving up after c_above (or down after !c_in) never has to come back
                    if (c_above && up < nb && ++tried < nb) {
                        sh.bstar = up;
                    } else if (!c_above && !c_in && down >= 0 && ++tried < nb) {
                        sh.bstar = down;
                    } else {
                        sh.go = 0;
                        sh.ca = cabove;
                        sh.ma = above;
                        if (!c_above && !c_in && lv == 0) sh.all = 1;   // nothing triggers: keep all >= floor
                    }
                }
                __syncthreads();
            }
        } else if (tid == 0 && sh.bstar < 0) {
            sh.all = 1;
        }
        __syncthreads();
        if (sh.all || sh.bstar < 0) {
            if (tid == 0) { *out_bkey = floor; *out_m = ALL_TIES; }
            __syncthreads();
            return;
        }
        if (tid == 0) sh.prefix = (prefix << bits) | (unsigned int)sh.bstar;
        __syncthreads();
    }
    // sh.prefix is the boundary key, hc[bstar] its ties: how many of them the first condition to trigger keeps.
    if (tid == 0) {
        const long long c = hc[sh.bstar];
        const double ma = sh.ma;
        long long m = c;
        if (sh.ca + c >= K && K - sh.ca < m) m = K - sh.ca;
        const double p = exp((double)__fsub_rn(key_value(sh.prefix), vmax));
        if (use_mass && p > 0.0 && ma + (double)c * p >= target) {
            // the host's cumulative sum crosses the target at the mp-th tie (ties share one probability)
            long long mp = (long long)ceil((target - ma) / p);
            mp = mp < 1 ? 1 : (mp > c ? c : mp);
            while (mp > 1 && ma + (double)(mp - 1) * p >= target) --mp;
            while (mp < c && ma + (double)mp * p < target) ++mp;
            if (mp < m) m = mp;
        }
        *out_bkey = sh.prefix;
        *out_m = m >= c ? ALL_TIES : (int)m;
    }
    __syncthreads();
}

// Whether the id at position j (< s1) is in the kept set, for a warp walking positions [s0, s1) 32 at a time (all
// lanes call it; positions are ids, or index the ascending candidates ids): keys above bkey, and of the ties at bkey
// the first m in id order (all when m == ALL_TIES); run counts the ties the walk has passed (this warp's offset in
// s_toff first), advanced here for the whole warp.
__device__ __forceinline__ bool kept_at(const float* work, const int* ids, int j, int s1, unsigned int bkey, int m,
                                        int lane, int& run) {
    const unsigned int k = j < s1 ? skey(work[ids ? ids[j] : j]) : 0u;
    const bool tie = j < s1 && k == bkey;
    const unsigned int tb = __ballot_sync(FULL_MASK, tie);
    const bool in = j < s1 && (k > bkey || (tie && (m == ALL_TIES || run + __popc(tb & ((1u << lane) - 1u)) < m)));
    run += __popc(tb);
    return in;
}

// 5. One block of SEL_THREADS: the kept set, the draw, the window update; out_host[0] = id, out_host[1] = NaN count
//    (-1: every logit is -inf). One block because the select is a chain of small dependent decisions; a grid-wide
//    chain would cost a launch (2-3 us) per decision. It works on sample_cut's candidates when there are any (copied
//    in id order from the bitmap into shared memory), else on the whole vocabulary (0.5-0.6 ms with top_k or top_p
//    in bench.sampler).
extern "C" __global__ void __launch_bounds__(SEL_THREADS)
sample_select(const float* __restrict__ work, const double* __restrict__ pw, const double* __restrict__ qw,
              const double* __restrict__ zpart, const double* __restrict__ qpart, int nzpart, int n,
              const SampleParams* __restrict__ P, SampleState* __restrict__ S, int* __restrict__ counts,
              int* __restrict__ ring, const unsigned int* __restrict__ bitmap, int* __restrict__ out_host) {
    __shared__ int hc[2048];
    __shared__ float hm[2048];
    extern __shared__ int s_cand[];               // CAND_CAP ids: the launch's dynamic shared memory
    __shared__ double dbuf[32];
    __shared__ long long lbuf[32];
    __shared__ SelShared sh;
    __shared__ unsigned int s_bkey;
    __shared__ int s_m, s_toff[SEL_WARPS], s_lo, s_hi, s_run, s_pick, s_nc;
    __shared__ double s_wm[SEL_WARPS], s_base, s_u, s_total, s_zk;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned long long mw = S->maxword;
    const unsigned int kmax = (unsigned int)(mw >> 32);
    const int nan = S->nan;
    if (nan || kmax == skey(NEG_INF)) {           // the host raises SamplingError; nothing advances
        if (tid == 0) { out_host[0] = -1; out_host[1] = nan ? nan : -1; }
        return;
    }
    const SampleParams p = *P;
    const float vmax = key_value(kmax);
    int pick = (int)(0xffffffffu - (unsigned int)(mw & 0xffffffffull));   // the argmax, lowest id on ties
    const int* ids = nullptr;                     // positions are ids (null) or index the candidates
    int cnt = n;
    if (p.temp > 0.f) {
        const bool k_on = top_k_on(p, n), p_on = top_p_on(p);
        const long long K = k_on ? (long long)p.top_k : (long long)n + 1;
        const unsigned int floor = min_p_floor(p, vmax, kmax);
        if (warp == 0) {
            const double z = zpart_sum(zpart, nzpart);
            if (tid == 0) s_zk = z;
        }
        if (S->nc >= 0) {                         // the candidates, ascending: each thread a run of bitmap words
            const int nwords = (n + 31) >> 5;
            const int per = (nwords + SEL_THREADS - 1) / SEL_THREADS;
            const int w0 = tid * per, w1 = min(nwords, w0 + per);
            int c = 0;
            for (int w = w0; w < w1; ++w) c += __popc(bitmap[w]);
            int incl = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int t = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += t;
            }
            if (lane == 31) s_toff[warp] = incl;
            __syncthreads();
            if (tid == 0) s_nc = exclusive_offsets(s_toff, SEL_WARPS);
            __syncthreads();
            int pos = s_toff[warp] + incl - c;
            for (int w = w0; w < w1; ++w) {
                unsigned int b = bitmap[w];
                while (b) {
                    if (pos < CAND_CAP) s_cand[pos] = (w << 5) + __ffs(b) - 1;
                    b &= b - 1u;
                    ++pos;
                }
            }
            __syncthreads();
            if (s_nc <= CAND_CAP) { ids = s_cand; cnt = s_nc; }   // sample_cut's bound: always
        }
        __syncthreads();
        if (k_on && p_on) {
            // top_p measures mass within the top_k survivors: find them first (count only), then their mass.
            select_prefix(work, pw, ids, cnt, K, 0.0, 0u, 0, vmax, hc, hm, sh, dbuf, lbuf, &s_bkey, &s_m);
            const unsigned int bk = s_bkey;
            double z = 0.0;
            for (int j = tid; j < cnt; j += blockDim.x) {
                const int i = ids ? ids[j] : j;
                if (skey(work[i]) > bk) z += pw[i];
            }
            z = block_sum_d(z, dbuf);
            if (tid == 0) {
                const double pb = exp((double)__fsub_rn(key_value(bk), vmax));
                s_zk = z + (double)(K - sh.ca) * pb;  // the boundary's kept ties
            }
            __syncthreads();
        }
        if (k_on || p_on) {
            const double target = p_on ? p.top_p * s_zk : __longlong_as_double(0x7ff0000000000000ll);
            select_prefix(work, pw, ids, cnt, K, target, floor, p_on ? 1 : 0, vmax, hc, hm, sh, dbuf, lbuf, &s_bkey,
                          &s_m);
        } else if (tid == 0) {                        // min_p alone (or nothing): every key >= floor
            s_bkey = floor;
            s_m = ALL_TIES;
        }
        __syncthreads();
        const unsigned int bkey = s_bkey;
        const int m = s_m;
        // The draw: the kept ids in id order in segments, each segment's tempered mass, the segment u x total falls in,
        // and a walk along it. The segments are sample_exp's runs of ids when every key >= the floor is kept from the
        // whole vocabulary (their masses are its qpart, so no pass here), else one a warp.
        if (!k_on && !p_on && ids == nullptr) {
            if (warp == 0) {
                const int per = (nzpart + 31) / 32;   // lane l: runs [per l, per l + per)
                const int b0 = min(nzpart, lane * per), b1 = min(nzpart, b0 + per);
                double ls = 0.0;
                for (int b = b0; b < b1; ++b) ls += qpart[b];
                double incl = ls;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const double t = __shfl_up_sync(FULL_MASK, incl, o);
                    if (lane >= o) incl += t;
                }
                const double total = __shfl_sync(FULL_MASK, incl, 31);
                const double u = rng_uniform(p.seed, S->step);
                const double r = u * total;
                double base = __shfl_up_sync(FULL_MASK, incl, 1);
                if (lane == 0) base = 0.0;
                int cross = -1, lastb = -1;
                double cbase = 0.0, lbase = 0.0;
                for (int b = b0; b < b1; ++b) {
                    const double q = qpart[b];
                    if (q > 0.0) {
                        if (cross < 0 && base + q > r) { cross = b; cbase = base; }
                        lastb = b;                    // rounding: the last run with mass
                        lbase = base;
                    }
                    base += q;
                }
                const unsigned int hit = __ballot_sync(FULL_MASK, cross >= 0);
                const unsigned int any = __ballot_sync(FULL_MASK, lastb >= 0);
                const int wl = hit ? __ffs(hit) - 1 : (any ? 31 - __clz(any) : 0);
                if (lane == wl) {
                    const int b = hit ? cross : lastb;
                    const int chunk = (n + nzpart - 1) / nzpart;
                    s_lo = b < 0 ? -1 : b * chunk;
                    s_hi = b < 0 ? -1 : min(n, b * chunk + chunk);
                    s_run = 0;
                    s_base = hit ? cbase : lbase;
                    s_u = u;
                    s_total = total;
                }
            }
        } else {
            const int seg = (cnt + SEL_WARPS - 1) / SEL_WARPS;
            const int s0 = min(cnt, warp * seg), s1 = min(cnt, s0 + seg);
            if (m != ALL_TIES) {                      // tie ranks in id order: each warp's offset
                int tc = 0;
                for (int j0 = s0; j0 < s1; j0 += 32) {
                    const int j = j0 + lane;
                    tc += __popc(__ballot_sync(FULL_MASK, j < s1 && skey(work[ids ? ids[j] : j]) == bkey));
                }
                if (lane == 0) s_toff[warp] = tc;
                __syncthreads();
                if (tid == 0) exclusive_offsets(s_toff, SEL_WARPS);
                __syncthreads();
            }
            double acc = 0.0;
            int run = m != ALL_TIES ? s_toff[warp] : 0;
            for (int j0 = s0; j0 < s1; j0 += 32) {
                const int j = j0 + lane;
                if (kept_at(work, ids, j, s1, bkey, m, lane, run)) acc += qw[ids ? ids[j] : j];
            }
            acc = warp_sum_d(acc);
            if (lane == 0) s_wm[warp] = acc;
            __syncthreads();
            if (tid == 0) {
                double total = 0.0;
                for (int w = 0; w < SEL_WARPS; ++w) total += s_wm[w];
                const double u = rng_uniform(p.seed, S->step);
                const double r = u * total;
                double base = 0.0;
                int ws = -1;
                for (int w = 0; w < SEL_WARPS; ++w) {
                    if (s_wm[w] > 0.0) {
                        if (base + s_wm[w] > r) { ws = w; break; }
                        ws = w;                       // rounding: the last warp with mass
                    }
                    base += s_wm[w];
                }
                if (ws >= 0 && !(base + s_wm[ws] > r)) {  // no crossing: the base of the last warp with mass
                    base = 0.0;
                    for (int w = 0; w < ws; ++w) base += s_wm[w];
                }
                s_lo = ws < 0 ? -1 : min(cnt, ws * seg);
                s_hi = ws < 0 ? -1 : min(cnt, ws * seg + seg);
                s_run = ws >= 0 && m != ALL_TIES ? s_toff[ws] : 0;
                s_base = base;
                s_u = u;
                s_total = total;
            }
        }
        __syncthreads();
        if (tid == 0) {                               // what the draw used (tests read these)
            S->u = s_u;
            S->total = s_total;
            S->zk = s_zk;
            S->bkey = bkey;
            S->m = m;
            s_pick = -1;
        }
        if (warp == 0 && s_lo >= 0) {                 // walk the chosen segment: the first id whose CDF passes r
            double base = s_base;
            const double r = s_u * s_total;
            const int lo = s_lo, hi = s_hi;
            int run = s_run, last = -1, found = -1;
            for (int j0 = lo; j0 < hi && found < 0; j0 += 32) {
                const int j = j0 + lane;
                const bool in = kept_at(work, ids, j, hi, bkey, m, lane, run);
                double q = in ? qw[ids ? ids[j] : j] : 0.0;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const double t = __shfl_up_sync(FULL_MASK, q, o);
                    if (lane >= o) q += t;
                }
                const unsigned int hit = __ballot_sync(FULL_MASK, in && base + q > r);
                const unsigned int kept = __ballot_sync(FULL_MASK, in);
                if (hit) found = j0 + __ffs(hit) - 1;
                if (kept) last = j0 + 31 - __clz(kept);
                base += __shfl_sync(FULL_MASK, q, 31);
            }
            const int at = found >= 0 ? found : last;
            if (lane == 0) s_pick = at < 0 ? -1 : (ids ? ids[at] : at);
        }
        __syncthreads();
        if (s_pick >= 0) pick = s_pick;              // else: no mass anywhere, the argmax (as the host's last id)
    }
    if (tid == 0) {
        out_host[0] = pick;
        out_host[1] = 0;
        S->pick = pick;
        S->nc = ids ? cnt : -1;
        if (p.temp > 0.f) S->step += 1ull;
        if (p.window > 0) {                           // the pick enters the penalty window; the oldest may leave
            int head = S->ring_head, len = S->ring_len;
            if (len == p.window) {
                const int old = ring[head];
                if (old >= 0) counts[old] -= 1;
            } else {
                ++len;
            }
            ring[head] = pick;
            counts[pick] += 1;
            S->ring_head = head + 1 == p.window ? 0 : head + 1;
            S->ring_len = len;
        }
    }
}
