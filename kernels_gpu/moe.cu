// moe.cu: the routing and the weighted sum of an MoE FFN on the device (the experts' matvecs are matvec_q8id_* /
// matvec_id_* in the matvec modules), so that a decode step needs no host round trip and fits in a CUDA graph.

#ifndef MOE_MAX_EXPERTS
#define MOE_MAX_EXPERTS 1024
#endif

// Softmax router, one warp a token: ids[t, j] = the j-th largest logit of row t (ties: the lower expert first, as a
// stable sort), wts[t, j] = its softmax probability, renormalized over the k selected when `norm` (the sum clamped at
// 6.103515625e-5 as llama.cpp). n_expert <= MOE_MAX_EXPERTS, k <= n_expert.
extern "C" __global__ void __launch_bounds__(32) moe_route_softmax(const float* __restrict__ logits, int n_expert,
                                                                  int k, int norm, i32* __restrict__ ids,
                                                                  float* __restrict__ wts) {
    __shared__ u8 taken[MOE_MAX_EXPERTS];
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (size_t)t * n_expert;
    float m = NEG_INF;
    for (int i = lane; i < n_expert; i += WARP) {
        m = fmaxf(m, l[i]);
        taken[i] = 0;
    }
    m = warp_max(m);
    float s = 0.0f;
    for (int i = lane; i < n_expert; i += WARP) s += expf(l[i] - m);
    s = warp_sum(s);
    __syncwarp();
    float sel = 0.0f;  // sum of the selected probabilities (lane 0)
    for (int j = 0; j < k; ++j) {
        float best = NEG_INF;
        int bi = -1;
        for (int i = lane; i < n_expert; i += WARP) {
            const float v = l[i];
            if (!taken[i] && (bi < 0 || v > best)) {  // ascending i: an equal value keeps the lower index
                best = v;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) {
                best = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            const int e = bi < 0 ? 0 : bi;  // only for NaN rows
            const float p = expf(best - m) / s;
            taken[e] = 1;
            ids[(size_t)t * k + j] = e;
            wts[(size_t)t * k + j] = p;
            sel += p;
        }
        __syncwarp();
    }
    if (norm && lane == 0) {
        const float d = fmaxf(sel, 6.103515625e-5f);
        for (int j = 0; j < k; ++j) wts[(size_t)t * k + j] /= d;
    }
}

// out[t, c] = sum over j < k of wts[t, j] * y[row(t, j), c], row(t, j) = rows[t k + j] (the row of that slot in the
// experts' outputs) or t k + j where rows is null; in slot order. One thread an output value.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const i32* __restrict__ rows,
                                       const float* __restrict__ wts, float* __restrict__ out, int n_tok, int k,
                                       int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_tok * n) return;
    const int t = (int)(i / n), c = (int)(i % n);
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
        const int slot = t * k + j;
        const int r = rows ? rows[slot] : slot;
        acc += wts[slot] * y[(size_t)r * n + c];
    }
    out[i] = acc;
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
