// moe.cu: the routing and the weighted sum of an MoE FFN on the device (the experts' matvecs are matvec_q8id_* /
// matvec_id_* in the matvec modules), so that a decode step needs no host round trip and fits in a CUDA graph.

#ifndef MOE_MAX_EXPERTS
#define MOE_MAX_EXPERTS 1024
#endif

// Softmax router, one CTA of MOE_ROUTE_THREADS a token: ids[t, j] = the expert of the j-th largest logit of row t
// (ties: the lower expert first, as a stable sort), wts[t, j] = its softmax probability, renormalized over the k
// selected when `norm` (the sum, in rank order, clamped at 6.103515625e-5 as llama.cpp). Each expert's rank is
// counted against all n_expert logits at once (no k serial rounds); n_expert <= MOE_MAX_EXPERTS, k <= MOE_MAX_K.
#define MOE_ROUTE_THREADS 128
#define MOE_MAX_K 64
template <int T>  // T threads in the CTA
__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < T / 32; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
    __syncthreads();  // red is reused by the next call
    return r;
}
// The rank of v[i] among v[0..n) in descending order, ties to the lower index (a stable sort's place): the routers
// select the experts of rank < k, each thread ranking its own against all of them at once.
__device__ __forceinline__ int moe_rank(const float* v, int n, int i) {
    const float x = v[i];
    int rank = 0;
    for (int j = 0; j < n; ++j) {
        const float y = v[j];
        rank += (y > x) || (y == x && j < i);
    }
    return rank;
}
// (the body of a CTA of T >= MOE_ROUTE_THREADS threads routing token t; l its logits, read through L2:
// moe_router_route's last CTA reads what other CTAs wrote during the launch. The first MOE_ROUTE_THREADS threads
// walk the experts, the rest only join the barriers and add identities to the reductions, so the sums are the
// same whatever T.)
template <int T>
__device__ __forceinline__ void route_softmax(const float* __restrict__ l, int n_expert, int k, int norm, int t,
                                              i32* __restrict__ ids, float* __restrict__ wts) {
    constexpr int R = MOE_ROUTE_THREADS;
    const int i0 = threadIdx.x < R ? (int)threadIdx.x : 1 << 30;  // past every loop's end
    __shared__ float v[MOE_MAX_EXPERTS];
    __shared__ float red[T / 32];
    __shared__ float sel[MOE_MAX_K];
    float m = NEG_INF;
    for (int i = i0; i < n_expert; i += R) {
        v[i] = __ldcg(l + i);
        m = fmaxf(m, v[i]);
    }
    if (threadIdx.x < k) {  // in bounds whatever happens below (NaN logits rank no expert)
        ids[(size_t)t * k + threadIdx.x] = 0;
        sel[threadIdx.x] = 0.0f;
    }
    m = block_reduce<T>(m, red, true);  // its barrier also publishes v
    float s = 0.0f;
    for (int i = i0; i < n_expert; i += R) s += expf(v[i] - m);
    s = block_reduce<T>(s, red, false);
    for (int i = i0; i < n_expert; i += R) {
        const int rank = moe_rank(v, n_expert, i);
        if (rank < k) {
            ids[(size_t)t * k + rank] = i;
            sel[rank] = expf(v[i] - m) / s;
        }
    }
    __syncthreads();
    if (threadIdx.x < k) {
        float w = sel[threadIdx.x];
        if (norm) {
            float total = 0.0f;
            for (int j = 0; j < k; ++j) total += sel[j];
            w /= fmaxf(total, 6.103515625e-5f);
        }
        wts[(size_t)t * k + threadIdx.x] = w;
    }
}

// Gated routers (llama.cpp's build_moe_ffn beyond plain softmax), one CTA of MOE_ROUTE_THREADS a token. z = the
// logits (+ the router's bias rbias, gpt-oss); p = softmax(z) (gating 0), sigmoid(z) (1) or z itself (2: gpt-oss,
// whose weights are the softmax of the k selected logits); experts selected by p + sbias (exp_probs_b, selection
// only) within the best n_group_used of n_groups groups when n_groups > 1 (a group scores the sum of its two best),
// the top k (ties: the lower expert, as moe_route_softmax); weights p of the selected (gating 2: their softmax),
// renormalized to sum 1 when norm (the sum clamped at 2^-14), times scale. rbias, sbias may be null.
#define MOE_MAX_GROUPS 64
template <int T>
__device__ __forceinline__ void route_gated(const float* __restrict__ l, const float* __restrict__ rbias,
                                            const float* __restrict__ sbias, int n_expert, int k, int gating, int norm,
                                            float scale, int n_groups, int n_group_used, int t, i32* __restrict__ ids,
                                            float* __restrict__ wts) {
    constexpr int R = MOE_ROUTE_THREADS;
    const int i0 = threadIdx.x < R ? (int)threadIdx.x : 1 << 30;  // past every loop's end
    __shared__ float p[MOE_MAX_EXPERTS];
    __shared__ float v[MOE_MAX_EXPERTS];  // the selection scores
    __shared__ float red[T / 32];
    __shared__ float sel[MOE_MAX_K];
    __shared__ float gscore[MOE_MAX_GROUPS];
    __shared__ int gkeep[MOE_MAX_GROUPS];
    const int tid = threadIdx.x;
    float m = NEG_INF;
    for (int i = i0; i < n_expert; i += R) {
        const float z = rbias ? __ldcg(l + i) + rbias[i] : __ldcg(l + i);
        p[i] = z;
        m = fmaxf(m, z);
    }
    if (tid < k) {  // in bounds whatever happens below (NaN logits rank no expert)
        ids[(size_t)t * k + tid] = 0;
        sel[tid] = 0.0f;
    }
    if (gating == 0) {
        m = block_reduce<T>(m, red, true);  // its barrier also publishes p
        float s = 0.0f;
        for (int i = i0; i < n_expert; i += R) s += expf(p[i] - m);
        s = block_reduce<T>(s, red, false);
        for (int i = i0; i < n_expert; i += R) p[i] = expf(p[i] - m) / s;
    } else if (gating == 1) {
        for (int i = i0; i < n_expert; i += R) p[i] = 1.0f / (1.0f + expf(-p[i]));
    }
    for (int i = i0; i < n_expert; i += R) v[i] = sbias ? p[i] + sbias[i] : p[i];
    __syncthreads();
    if (n_groups > 1) {
        const int gsize = n_expert / n_groups;
        for (int g = i0; g < n_groups; g += R) {
            float b1 = NEG_INF, b2 = NEG_INF;
            for (int i = g * gsize; i < (g + 1) * gsize; ++i) {
                const float x = v[i];
                if (x > b1) {
                    b2 = b1;
                    b1 = x;
                } else if (x > b2) {
                    b2 = x;
                }
            }
            gscore[g] = gsize > 1 ? b1 + b2 : b1;
        }
        __syncthreads();
        for (int g = i0; g < n_groups; g += R) {
            int rank = 0;
            for (int j = 0; j < n_groups; ++j) rank += (gscore[j] > gscore[g]) || (gscore[j] == gscore[g] && j < g);
            gkeep[g] = rank < n_group_used;
        }
        __syncthreads();
        for (int i = i0; i < n_expert; i += R)
            if (!gkeep[i / gsize]) v[i] = NEG_INF;
        __syncthreads();
    }
    for (int i = i0; i < n_expert; i += R) {
        const int rank = moe_rank(v, n_expert, i);
        if (rank < k) {
            ids[(size_t)t * k + rank] = i;
            sel[rank] = p[i];
        }
    }
    __syncthreads();
    float w = 0.0f;
    if (tid < k) {
        w = sel[tid];
        if (gating == 2) {
            float mx = NEG_INF, z = 0.0f;
            for (int j = 0; j < k; ++j) mx = fmaxf(mx, sel[j]);
            for (int j = 0; j < k; ++j) z += expf(sel[j] - mx);
            w = expf(w - mx) / z;
        }
    }
    __syncthreads();
    if (tid < k) sel[tid] = w;
    __syncthreads();
    if (tid < k) {
        if (norm) {
            float total = 0.0f;
            for (int j = 0; j < k; ++j) total += sel[j];
            w /= fmaxf(total, 6.103515625e-5f);
        }
        wts[(size_t)t * k + tid] = w * scale;
    }
}

extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS) moe_route_softmax(const float* __restrict__ logits,
                                                                                 int n_expert, int k, int norm,
                                                                                 i32* __restrict__ ids,
                                                                                 float* __restrict__ wts) {
    const int t = blockIdx.x;
    route_softmax<MOE_ROUTE_THREADS>(logits + (size_t)t * n_expert, n_expert, k, norm, t, ids, wts);
}

extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS) moe_route_gated(
    const float* __restrict__ logits, const float* __restrict__ rbias, const float* __restrict__ sbias, int n_expert,
    int k, int gating, int norm, float scale, int n_groups, int n_group_used, i32* __restrict__ ids,
    float* __restrict__ wts) {
    const int t = blockIdx.x;
    route_gated<MOE_ROUTE_THREADS>(logits + (size_t)t * n_expert, rbias, sbias, n_expert, k, gating, norm, scale,
                                   n_groups, n_group_used, t, ids, wts);
}

// The router of one decode token and its routing in one launch (F32 router rows of n_in % 8 == 0 values, 16-byte
// aligned): each CTA computes MVF_WARPS / wpr of the logits as matvec_f32_1 does (the same sums in the same order)
// and, where xq is given (n_in % 32 == 0), quantizes its share of x's blocks of 32 as quantize_q8_1 (one warp a
// block, the same bytes) for the experts' q8 matvecs; the last CTA to finish (an atomic count in *done, which
// that CTA sets back to 0) routes the logits as moe_route_softmax (plain != 0) or moe_route_gated.
extern "C" __global__ void __launch_bounds__(256) moe_router_route(
    const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ logits, int n_expert, int n_in, int wpr,
    int plain, const float* __restrict__ rbias, const float* __restrict__ sbias, int k, int gating, int norm,
    float scale, int n_groups, int n_group_used, i32* __restrict__ ids, float* __restrict__ wts, i8* __restrict__ xq,
    float4* __restrict__ xm, unsigned int* done) {
    __shared__ int last;
    if (xq) {
        for (int blk = blockIdx.x * 8 + (threadIdx.x >> 5); blk < (n_in >> 5); blk += gridDim.x * 8) {
            const int i = blk * 32 + (threadIdx.x & 31);
            q8_block_store(x[i], xq, xm, i);
        }
    }
    matvec_float_body<0, 1, true>(w, x, logits, n_expert, n_in, 1, wpr);
    __syncthreads();  // the CTA's logits written (by its warps' lane 0) before thread 0 counts the CTA
    if (threadIdx.x == 0) {
        __threadfence();  // cumulative: what the CTA wrote is visible device-wide before the count
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) *done = 0;  // for the next launch (a replayed graph's)
    __threadfence();
    if (plain) route_softmax<256>(logits, n_expert, k, norm, 0, ids, wts);
    else route_gated<256>(logits, rbias, sbias, n_expert, k, gating, norm, scale, n_groups, n_group_used, 0, ids, wts);
}

// y[r, c] += bias[e[r], c] for rows r < n_rows of y (n_rows, n) where e[r] >= 0 (an expert's bias row; -1: a padding
// row of a prefill's groups, left as it is). One thread an element.
extern "C" __global__ void moe_add_bias(float* __restrict__ y, const float* __restrict__ bias, const i32* __restrict__ e,
                                        int n_rows, int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_rows * n) return;
    const int r = (int)(i / n), x = e[r];
    if (x >= 0) y[i] += bias[(size_t)x * n + (int)(i % n)];
}

// out[t, c] = add[t, c] + sum over j < k of wts[t, j] * y[row(t, j), c], row(t, j) = rows[t k + j] (the row of that
// slot in the experts' outputs) or t k + j where rows is null, summed in slot order; add (the residual stream) may be
// null: then the sum alone. One thread an output value.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const i32* __restrict__ rows,
                                       const float* __restrict__ wts, const float* __restrict__ add,
                                       float* __restrict__ out, int n_tok, int k, int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_tok * n) return;
    const int t = (int)(i / n), c = (int)(i % n);
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        const int slot = t * k + j;
        const int r = rows ? rows[slot] : slot;
        acc += wts[slot] * y[(size_t)r * n + c];
    }
    out[i] = add ? add[i] + acc : acc;
}

// Gathers rows of x (n_rows, n) f32 into fp16 (len(src), n): row i is x[src[i]], zeros where src[i] < 0 (padding).
extern "C" __global__ void moe_gather_f16(const float* __restrict__ x, const i32* __restrict__ src,
                                          u16* __restrict__ out, int n_out_rows, int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_out_rows * n) return;
    const int r = (int)(i / n), c = (int)(i % n);
    const int s = src[r];
    out[i] = s < 0 ? (u16)0 : f2h(x[(size_t)s * n + c]);
}

// a = glu_act(gate, up, act) (act 0 silu, 1 gelu, 2 swiglu_oai), quantized as quantize_q8_1 (matvec_q8.cu) in the same
// kernel: the down projection's q8 input. n % 32 == 0: a warp is one q8 block, in or out as a whole.
extern "C" __global__ void __launch_bounds__(256) moe_glu_q8(const float* __restrict__ gate, const float* __restrict__ up,
                                                            int act, i8* __restrict__ xq, float4* __restrict__ xm,
                                                            int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    q8_block_store(glu_act(gate[i], up[i], act), xq, xm, i);
}

// Groups a batch's (token, slot) pairs by expert for moe_mma.cu, on the device (no copy of the ids to the host):
// ids (n_pairs = n_tok k,) -> each pair's row dest[i] (its expert's rows are consecutive, experts in order; within
// an expert the order is the atomics', which changes no result: a GEMM row depends on its own activations only),
// src[row] = the row's token, tiles (expert, first row, rows <= bm, 0) for every bm rows of an expert, and their
// count in *n_tiles (the GEMMs' grids are sized for the most there can be: n_pairs / bm + experts used). One CTA.
#define MOE_GROUP_THREADS 1024
extern "C" __global__ void __launch_bounds__(MOE_GROUP_THREADS) moe_group(const i32* __restrict__ ids, int n_pairs,
                                                                           int k, int n_expert, int bm,
                                                                           i32* __restrict__ tiles,
                                                                           i32* __restrict__ n_tiles,
                                                                           i32* __restrict__ src,
                                                                           i32* __restrict__ dest) {
    __shared__ int cnt[MOE_MAX_EXPERTS], off[MOE_MAX_EXPERTS], toff[MOE_MAX_EXPERTS + 1];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) dest[i] = atomicAdd(&cnt[ids[i]], 1);  // the rank
    __syncthreads();
    if (threadIdx.x == 0) {  // exclusive scans of rows and tiles (n_expert <= MOE_MAX_EXPERTS: a few microseconds)
        int rows = 0, nt = 0;
        for (int e = 0; e < n_expert; ++e) {
            off[e] = rows;
            toff[e] = nt;
            rows += cnt[e];
            nt += (cnt[e] + bm - 1) / bm;
        }
        toff[n_expert] = nt;
        *n_tiles = nt;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x)
        for (int j = 0; j < toff[e + 1] - toff[e]; ++j) {
            i32* t = tiles + 4 * (toff[e] + j);
            t[0] = e;
            t[1] = off[e] + j * bm;
            t[2] = min(bm, cnt[e] - j * bm);
            t[3] = 0;
        }
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
        const int r = off[ids[i]] + dest[i];
        dest[i] = r;
        src[r] = i / k;
    }
}
