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

// One thread: out_host[0] = chosen id, out_host[1] = NaN count (mapped pinned memory, read after the step).
extern "C" __global__ void argmax_finish(const int* __restrict__ state, int* __restrict__ out_host) {
    const unsigned long long w = reinterpret_cast<const unsigned long long*>(state + 2)[0];
    out_host[0] = (int)(0xffffffffu - (unsigned int)(w & 0xffffffffull));
    out_host[1] = state[4];
}

// ================================================================================================================
// Sampled picks (engine/cuda/sampler.py drives these; engine/sampling.py is the reference semantics):
// penalties -> top_k -> top_p -> min_p (all on the untempered distribution) -> temperature -> one draw.
//
// Every setting that changes between requests or steps is read from SampleParams / SampleState in device memory,
// never from kernel arguments, so the launches sit in a CUDA graph captured once and replayed (DESIGN §5). Kernel
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

struct SampleState {                  // engine/cuda/sampler.py STATE_DTYPE mirrors this layout (72 bytes)
    unsigned long long maxword;       // argmax word of the penalized logits (cleared each step)
    int nan;                          // NaN logits seen this step (cleared each step)
    int pad0;
    unsigned long long step;          // draws so far: the RNG counter
    int ring_head, ring_len;          // the penalty window's ring
    double u;                         // what the last draw used (tests read these)
    double total;                     // tempered mass of the kept set
    double zk;                        // untempered mass the top_p target is relative to
    unsigned int bkey;                // the kept set: key > bkey, or key == bkey among the first m such ids
    int m;
    int pick;
    int pad1;
};

#define SEL_THREADS 1024
#define SEL_WARPS (SEL_THREADS / 32)
#define ALL_TIES 0x7fffffff
#define FULL_MASK 0xffffffffu
#define SAMPLE_GRID 264

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
//    the argmax word of the result and the NaN count into the state. Grid-stride, any grid.
extern "C" __global__ void sample_prep(const float* __restrict__ logits, int n, const SampleParams* __restrict__ P,
                                       const int* __restrict__ counts, float* __restrict__ work,
                                       SampleState* __restrict__ S) {
    const int pen = P->penalties;
    const float rep = P->pen_repeat, freq = P->pen_freq, pres = P->pen_present;
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
        const unsigned long long w = ((unsigned long long)skey(v) << 32) | (0xffffffffu - (unsigned int)i);
        best = w > best ? w : best;
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
}

// 2. Per token, relative to the maximum: pw = exp(v - vmax) (untempered, what top_p measures) and
//    qw = exp(v/T - vmax/T) (the draw's weights), each exactly as engine/sampling.py computes them (the difference
//    in float32, the exp in float64); zpart[block] = this block's sum of pw in a fixed order. Grid: SAMPLE_GRID x 256.
extern "C" __global__ void sample_exp(const float* __restrict__ work, int n, const SampleParams* __restrict__ P,
                                      const SampleState* __restrict__ S, double* __restrict__ pw,
                                      double* __restrict__ qw, double* __restrict__ zpart) {
    __shared__ double buf[32];
    const float temp = P->temp;
    if (temp <= 0.f || S->nan) return;          // greedy needs neither; NaN: the step fails
    const float vmax = key_value((unsigned int)(S->maxword >> 32));
    const float tmax = __fdiv_rn(vmax, temp);
    double z = 0.0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = work[i];
        const double p = exp((double)__fsub_rn(v, vmax));
        pw[i] = p;
        qw[i] = exp((double)__fsub_rn(__fdiv_rn(v, temp), tmax));
        z += p;
    }
    z = block_sum_d(z, buf);
    if (threadIdx.x == 0) zpart[blockIdx.x] = z;
}

struct SelShared {
    unsigned int prefix;              // key bits fixed by the levels so far
    int bstar;                        // this level's bucket (-1: none triggers)
    long long ca;                     // tokens above the current range (exact)
    double ma;                        // their untempered mass (exact)
    int all;                          // no condition triggered: keep every key >= floor
    int go;                           // the bucket check's loop flag
};

// Radix select of the prefix: the first position (in the sorted order, keys >= floor only) where the count reaches
// K or the mass reaches target. Leaves (bkey, m) in *out_bkey / *out_m (m = ALL_TIES: every tie at bkey) and the
// count / exact mass above bkey in sh. Whole block; use_mass = 0 makes it count-only (exact without checks).
__device__ void select_prefix(const float* __restrict__ work, const double* __restrict__ pw, int n, long long K,
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
        for (int i = tid; i < n; i += blockDim.x) {
            const unsigned int k = skey(work[i]);
            if (k < floor || (ps < 32 && (k >> ps) != prefix)) continue;
            const int b = (int)((k >> shift) & (unsigned int)(nb - 1));
            atomicAdd(&hc[b], 1);
            if (use_mass) atomicAdd(&hm[b], (float)pw[i]);
        }
        __syncthreads();
        if (warp == 0) {                              // scan buckets from the top, 32 at a time
            long long ca = sh.ca;
            double ma = sh.ma;
            int found = -1;
            long long ca_found = 0;
            for (int base = nb - 32; base >= 0; base -= 32) {
                const int b = base + 31 - lane;       // lane 0: the highest bucket of this chunk
                const int c = hc[b];
                long long cc = c;
                double mm = use_mass ? (double)hm[b] : 0.0;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const long long tc = __shfl_up_sync(FULL_MASK, cc, o);
                    const double tm = __shfl_up_sync(FULL_MASK, mm, o);
                    if (lane >= o) { cc += tc; mm += tm; }
                }
                const bool hit = c > 0 && (ca + cc >= K || (use_mass && ma + mm >= target));
                const unsigned int bal = __ballot_sync(FULL_MASK, hit);
                if (bal) {
                    const int l = __ffs(bal) - 1;
                    found = base + 31 - l;
                    ca_found = ca + __shfl_sync(FULL_MASK, cc - c, l);
                    break;
                }
                ca += __shfl_sync(FULL_MASK, cc, 31);
                ma += __shfl_sync(FULL_MASK, mm, 31);
            }
            if (lane == 0) {
                sh.bstar = found;
                if (!use_mass && found >= 0) sh.ca = ca_found;
            }
        }
        __syncthreads();
        if (use_mass) {
            // Check the bucket with exact sums; move it while rounding put it on the wrong side.
            if (tid == 0) {
                sh.go = 1;
                if (sh.bstar < 0) {                   // start from the lowest non-empty bucket
                    int b = 0;
                    while (b < nb && hc[b] == 0) ++b;
                    sh.bstar = b < nb ? b : -1;
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
                for (int i = tid; i < n; i += blockDim.x) {
                    const unsigned int k = skey(work[i]);
                    if (k > hi && k >= floor) above += pw[i];
                    else if (k >= lo_f && k <= hi) in += pw[i];
                }
                long long cabove = 0;
                for (int bb = b + 1 + tid; bb < nb; bb += blockDim.x) cabove += hc[bb];
                above = block_sum_d(above, dbuf);
                in = block_sum_d(in, dbuf);
                cabove = block_sum_ll(cabove, lbuf) + sh.ca;
                __syncthreads();
                if (tid == 0) {
                    const bool c_above = cabove >= K || above >= target;
                    const bool c_in = cabove + hc[b] >= K || above + in >= target;
                    int up = b + 1, down = b - 1;
                    while (up < nb && hc[up] == 0) ++up;
                    while (down >= 0 && hc[down] == 0) --down;
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

// Whether id i (< s1) is in the kept set, for a warp walking [s0, s1) 32 ids at a time (all lanes call it): keys
// above bkey, and of the ties at bkey the first m in id order (all when m == ALL_TIES); run counts the ties the walk
// has passed (this warp's offset in s_toff first), advanced here for the whole warp.
__device__ __forceinline__ bool kept_at(const float* work, int i, int s1, unsigned int bkey, int m, int lane,
                                        int& run) {
    const unsigned int k = i < s1 ? skey(work[i]) : 0u;
    const bool tie = i < s1 && k == bkey;
    const unsigned int tb = __ballot_sync(FULL_MASK, tie);
    const bool in = i < s1 && (k > bkey || (tie && (m == ALL_TIES || run + __popc(tb & ((1u << lane) - 1u)) < m)));
    run += __popc(tb);
    return in;
}

// 3. One block of SEL_THREADS: the kept set, the draw, the window update; out_host[0] = id, out_host[1] = NaN count
//    (-1: every logit is -inf). One block because the select is a chain of small dependent decisions: passes over
//    the ~1 MB of pw/work come from L2, and a grid-wide chain would cost a launch (2-3 us) per decision.
extern "C" __global__ void __launch_bounds__(SEL_THREADS)
sample_select(const float* __restrict__ work, const double* __restrict__ pw, const double* __restrict__ qw,
              const double* __restrict__ zpart, int nzpart, int n, const SampleParams* __restrict__ P,
              SampleState* __restrict__ S, int* __restrict__ counts, int* __restrict__ ring,
              int* __restrict__ out_host) {
    __shared__ int hc[2048];
    __shared__ float hm[2048];
    __shared__ double dbuf[32];
    __shared__ long long lbuf[32];
    __shared__ SelShared sh;
    __shared__ unsigned int s_bkey;
    __shared__ int s_m, s_toff[SEL_WARPS], s_wstar, s_pick;
    __shared__ double s_wm[SEL_WARPS], s_base, s_r, s_zk;
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
    if (p.temp > 0.f) {
        const bool k_on = p.top_k > 0 && p.top_k < n;
        const bool p_on = p.top_p < 1.0;
        const long long K = k_on ? (long long)p.top_k : (long long)n + 1;
        unsigned int floor = 0u;
        if (p.log_min_p > -1e300) {               // min_p: keep v >= vmax + log(min_p), compared in float64
            floor = skey(__double2float_ru((double)vmax + p.log_min_p));
            if (floor > kmax) floor = kmax;           // min_p > 1 would keep nothing: keep the top
        }
        if (tid == 0) {
            double z = 0.0;
            for (int b = 0; b < nzpart; ++b) z += zpart[b];
            s_zk = z;
        }
        __syncthreads();
        if (k_on && p_on) {
            // top_p measures mass within the top_k survivors: find them first (count only), then their mass.
            select_prefix(work, pw, n, K, 0.0, 0u, 0, vmax, hc, hm, sh, dbuf, lbuf, &s_bkey, &s_m);
            const unsigned int bk = s_bkey;
            double z = 0.0;
            for (int i = tid; i < n; i += blockDim.x)
                if (skey(work[i]) > bk) z += pw[i];
            z = block_sum_d(z, dbuf);
            if (tid == 0) {
                const double pb = exp((double)__fsub_rn(key_value(bk), vmax));
                s_zk = z + (double)(K - sh.ca) * pb;  // the boundary's kept ties
            }
            __syncthreads();
        }
        if (k_on || p_on) {
            const double target = p_on ? p.top_p * s_zk : __longlong_as_double(0x7ff0000000000000ll);
            select_prefix(work, pw, n, K, target, floor, p_on ? 1 : 0, vmax, hc, hm, sh, dbuf, lbuf, &s_bkey, &s_m);
        } else if (tid == 0) {                        // min_p alone (or nothing): every key >= floor
            s_bkey = floor;
            s_m = ALL_TIES;
        }
        __syncthreads();
        const unsigned int bkey = s_bkey;
        const int m = s_m;
        // The draw: the kept ids in id order, each warp a contiguous segment.
        const int seg = (n + SEL_WARPS - 1) / SEL_WARPS;
        const int s0 = warp * seg, s1 = min(n, s0 + seg);
        if (m != ALL_TIES) {                          // tie ranks in id order: each warp's offset
            int tc = 0;
            for (int i0 = s0; i0 < s1; i0 += 32) {
                const int i = i0 + lane;
                tc += __popc(__ballot_sync(FULL_MASK, i < s1 && skey(work[i]) == bkey));
            }
            if (lane == 0) s_toff[warp] = tc;
            __syncthreads();
            if (tid == 0) {
                int acc = 0;
                for (int w = 0; w < SEL_WARPS; ++w) { const int t = s_toff[w]; s_toff[w] = acc; acc += t; }
            }
            __syncthreads();
        }
        double acc = 0.0;
        int run = m != ALL_TIES ? s_toff[warp] : 0;
        for (int i0 = s0; i0 < s1; i0 += 32) {
            const int i = i0 + lane;
            if (kept_at(work, i, s1, bkey, m, lane, run)) acc += qw[i];
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
                    ws = w;                           // rounding: the last warp with mass
                }
                base += s_wm[w];
            }
            if (ws >= 0 && !(base + s_wm[ws] > r)) {  // no crossing: recompute the base of the last warp with mass
                base = 0.0;
                for (int w = 0; w < ws; ++w) base += s_wm[w];
            }
            s_wstar = ws;
            s_base = base;
            s_r = r;
            s_pick = -1;
            S->u = u;
            S->total = total;
            S->zk = s_zk;
            S->bkey = bkey;
            S->m = m;
        }
        __syncthreads();
        if (warp == s_wstar) {                        // walk the chosen segment: the first id whose CDF passes r
            double base = s_base;
            const double r = s_r;
            int last = -1, found = -1;
            run = m != ALL_TIES ? s_toff[warp] : 0;
            for (int i0 = s0; i0 < s1 && found < 0; i0 += 32) {
                const int i = i0 + lane;
                const bool in = kept_at(work, i, s1, bkey, m, lane, run);
                double q = in ? qw[i] : 0.0;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const double t = __shfl_up_sync(FULL_MASK, q, o);
                    if (lane >= o) q += t;
                }
                const unsigned int hit = __ballot_sync(FULL_MASK, in && base + q > r);
                const unsigned int kept = __ballot_sync(FULL_MASK, in);
                if (hit) found = i0 + __ffs(hit) - 1;
                if (kept) last = i0 + 31 - __clz(kept);
                base += __shfl_sync(FULL_MASK, q, 31);
            }
            if (lane == 0) s_pick = found >= 0 ? found : last;
        }
        __syncthreads();
        if (s_pick >= 0) pick = s_pick;              // else: no mass anywhere, the argmax (as the host's last id)
    }
    if (tid == 0) {
        out_host[0] = pick;
        out_host[1] = 0;
        S->pick = pick;
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
