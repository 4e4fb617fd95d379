// attention.cu: causal attention of a batch of queries over one layer's KV cache, flash style (online softmax,
// no score matrix), reading the cache rows in their stored type: code 0 f32, 1 f16, 2 q8_0, 3 q4_0
// (block_q8_0: d fp16, qs[32] int8; block_q4_0: d fp16, qs[16] nibbles, element j low / j + 16 high of qs[j]).
// Masks: key c is visible to a query at position p iff c <= p and (n_swa == 0 or p - c < n_swa).
//
// A CTA (4 warps) takes one token, HPC query heads of one GQA group (which share the K/V rows) and one split
// of the keys; lane l holds elements [l*E, l*E + E) of a row (head_dim = 32 E). Each warp runs its own online
// softmax over every 4th group of U keys; the 4 warps are merged through shared memory. With several splits
// the partial (max, sum, acc) go to a workspace and attn_combine merges them (flash-decoding).
// chunk <= 0 asks for a dynamic split: chunk = max(-chunk, ceil(n_eff / n_splits)) with n_eff read from the
// positions on the device, so a CUDA graph captured once (grid fixed by the cache size) serves every position.

#define ATT_WARPS 4

// row elements [lane*E, lane*E + E) of a cache row of type `code`, as float32
template <int E>
__device__ __forceinline__ void load_row(int code, const u8* __restrict__ row, int lane, float (&v)[E]) {
    const int e0 = lane * E;
    if (code == 0) {
        const float* r = (const float*)row + e0;
        if constexpr (E % 4 == 0) {
#pragma unroll
            for (int k = 0; k < E; k += 4) {
                const float4 a = *(const float4*)(r + k);
                v[k] = a.x; v[k + 1] = a.y; v[k + 2] = a.z; v[k + 3] = a.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < E; ++k) v[k] = r[k];
        }
    } else if (code == 1) {
        const u16* r = (const u16*)row + e0;
        if constexpr (E % 2 == 0) {
#pragma unroll
            for (int k = 0; k < E; k += 2) {
                const u32 a = *(const u32*)(r + k);
                v[k] = h2f((u16)(a & 0xffffu));
                v[k + 1] = h2f((u16)(a >> 16));
            }
        } else {
#pragma unroll
            for (int k = 0; k < E; ++k) v[k] = h2f(r[k]);
        }
    } else if (code == 2) {
#pragma unroll
        for (int k = 0; k < E; ++k) {
            const int e = e0 + k;
            const u8* blk = row + (e >> 5) * 34;
            v[k] = (float)(i8)blk[2 + (e & 31)] * ld_f16(blk);
        }
    } else {
#pragma unroll
        for (int k = 0; k < E; ++k) {
            const int e = e0 + k, o = e & 31;
            const u8* blk = row + (e >> 5) * 18;
            const u32 byte = blk[2 + (o & 15)];
            const int q = (int)(o < 16 ? (byte & 15u) : (byte >> 4)) - 8;
            v[k] = ld_f16(blk) * (float)q;
        }
    }
}

template <int E, int HPC>
__device__ __forceinline__ void attn_body(const float* __restrict__ q, const u8* __restrict__ kc,
                                          const u8* __restrict__ vc, const i32* __restrict__ pos,
                                          float* __restrict__ out, float* __restrict__ part_ms,
                                          float* __restrict__ part_acc, int n_head, int n_head_kv, int code_k,
                                          int code_v, int rbk, int rbv, int n_kv, int chunk, int n_splits,
                                          float scale, int n_swa) {
    constexpr int D = 32 * E;
    constexpr int U = E >= 8 ? 2 : 4;  // keys a warp has in flight
    __shared__ float s_m[ATT_WARPS][HPC], s_s[ATT_WARPS][HPC];
    __shared__ float s_acc[ATT_WARPS][HPC][D];

    const int split = blockIdx.x, t = blockIdx.z;
    const int G = n_head / n_head_kv;
    const int gpk = (G + HPC - 1) / HPC;  // CTAs per GQA group
    const int hk = blockIdx.y / gpk;
    const int h0 = hk * G + (blockIdx.y % gpk) * HPC;
    const int nh = min(HPC, hk * G + G - h0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    if (chunk <= 0) {  // dynamic split (graph replays): the keys in use follow the positions on the device
        const int n_eff = min(n_kv, pos[gridDim.z - 1] + 1);  // positions ascend: the last token sees the most
        chunk = max(-chunk, (n_eff + n_splits - 1) / n_splits);
    }
    const int p = pos[t];
    const int lo = n_swa > 0 ? max(0, p - n_swa + 1) : 0;
    const int hi = min(p, n_kv - 1) + 1;  // exclusive
    const int c0 = max(lo, split * chunk), c1 = min(hi, (split + 1) * chunk);
    if (c0 >= c1 && n_splits > 1) {  // an empty split (CTA-uniform): mark it for attn_combine, which skips it
        for (int g = threadIdx.x; g < nh; g += blockDim.x) {
            const size_t oh = (size_t)t * n_head + h0 + g;
            part_ms[(oh * n_splits + split) * 2] = NEG_INF;
            part_ms[(oh * n_splits + split) * 2 + 1] = 0.0f;
        }
        return;
    }

    float qr[HPC][E];
#pragma unroll
    for (int g = 0; g < HPC; ++g)
#pragma unroll
        for (int e = 0; e < E; ++e)
            qr[g][e] = g < nh ? q[((size_t)t * n_head + h0 + g) * D + lane * E + e] : 0.0f;

    float m[HPC], ssum[HPC], acc[HPC][E];
#pragma unroll
    for (int g = 0; g < HPC; ++g) {
        m[g] = NEG_INF;
        ssum[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
    }

    const size_t kstride = (size_t)n_head_kv * rbk, vstride = (size_t)n_head_kv * rbv;
    const u8* kbase = kc + (size_t)hk * rbk;
    const u8* vbase = vc + (size_t)hk * rbv;
    for (int c = c0 + warp * U; c < c1; c += ATT_WARPS * U) {
        float kr[U][E], vr[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int cc = min(c + u, c1 - 1);  // a valid row; masked below
            load_row<E>(code_k, kbase + (size_t)cc * kstride, lane, kr[u]);
            load_row<E>(code_v, vbase + (size_t)cc * vstride, lane, vr[u]);
        }
        float sc[U][HPC];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int g = 0; g < HPC; ++g) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < E; ++e) d += qr[g][e] * kr[u][e];
                d = warp_sum(d) * scale;
                sc[u][g] = c + u < c1 ? d : NEG_INF;
            }
#pragma unroll
        for (int g = 0; g < HPC; ++g) {
            float mx = sc[0][g];
#pragma unroll
            for (int u = 1; u < U; ++u) mx = fmaxf(mx, sc[u][g]);
            const float m_new = fmaxf(m[g], mx);  // finite: key c is always valid
            const float alpha = expf(m[g] - m_new);
            ssum[g] *= alpha;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] *= alpha;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float pw = expf(sc[u][g] - m_new);
                ssum[g] += pw;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] += pw * vr[u][e];
            }
            m[g] = m_new;
        }
    }

#pragma unroll
    for (int g = 0; g < HPC; ++g) {
#pragma unroll
        for (int e = 0; e < E; ++e) s_acc[warp][g][lane * E + e] = acc[g][e];
        if (lane == 0) {
            s_m[warp][g] = m[g];
            s_s[warp][g] = ssum[g];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nh * D; idx += ATT_WARPS * WARP) {
        const int g = idx / D, j = idx % D;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, s_m[w][g]);
        float S = 0.0f, A = 0.0f;
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < ATT_WARPS; ++w) {
                const float f = expf(s_m[w][g] - M);
                S += s_s[w][g] * f;
                A += s_acc[w][g][j] * f;
            }
        }
        const size_t oh = (size_t)t * n_head + h0 + g;  // (token, head)
        if (n_splits == 1) {
            out[oh * D + j] = S > 0.0f ? A / S : 0.0f;
        } else {
            part_acc[(oh * n_splits + split) * D + j] = A;
            if (j == 0) {
                part_ms[(oh * n_splits + split) * 2] = M;
                part_ms[(oh * n_splits + split) * 2 + 1] = S;
            }
        }
    }
}

// merge the splits of one (token, head): grid n_tok * n_head, D threads
extern "C" __global__ void attn_combine(const float* __restrict__ part_ms, const float* __restrict__ part_acc,
                                        float* __restrict__ out, int n_splits, int D) {
    const size_t oh = blockIdx.x;
    const int j = threadIdx.x;
    if (j >= D) return;
    float M = NEG_INF;
    for (int s = 0; s < n_splits; ++s) M = fmaxf(M, part_ms[(oh * n_splits + s) * 2]);
    float S = 0.0f, A = 0.0f;
    if (M != NEG_INF) {
        for (int s = 0; s < n_splits; ++s) {
            if (part_ms[(oh * n_splits + s) * 2] == NEG_INF) continue;  // empty split: part_acc not written
            const float f = expf(part_ms[(oh * n_splits + s) * 2] - M);
            S += part_ms[(oh * n_splits + s) * 2 + 1] * f;
            A += part_acc[(oh * n_splits + s) * D + j] * f;
        }
    }
    out[oh * D + j] = S > 0.0f ? A / S : 0.0f;
}

#define ATTN_ENTRY(E, HPC)                                                                                    \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP) attn_e##E##_h##HPC(                        \
        const float* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc,                    \
        const i32* __restrict__ pos, float* __restrict__ out, float* __restrict__ part_ms,                    \
        float* __restrict__ part_acc, int n_head, int n_head_kv, int code_k, int code_v, int rbk, int rbv,    \
        int n_kv, int chunk, int n_splits, float scale, int n_swa, int indirect) {                            \
        if (indirect) { /* kc, vc: slots holding the cache's addresses (graph replays over another cache) */  \
            kc = *(const u8* const*)kc;                                                                       \
            vc = *(const u8* const*)vc;                                                                       \
        }                                                                                                     \
        attn_body<E, HPC>(q, kc, vc, pos, out, part_ms, part_acc, n_head, n_head_kv, code_k, code_v, rbk, rbv, \
                          n_kv, chunk, n_splits, scale, n_swa);                                               \
    }

// One kernel per compiled module: attention.py builds the module with -DATT_E=E -DATT_HPC=HPC for the variant a
// layer needs (head_dim = 32 E; HPC * E <= 32 keeps the accumulators in registers), so only used variants compile.
#define ATTN_ENTRY_X(E, HPC) ATTN_ENTRY(E, HPC)
#ifdef ATT_E
ATTN_ENTRY_X(ATT_E, ATT_HPC)
#endif
