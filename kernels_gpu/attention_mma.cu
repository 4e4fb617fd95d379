// attention_mma.cu (after attention.cu; built with -DATTM_D=head_dim, 64 or 128): the tiled prefill attention of an
// f16 KV cache on the tensor cores, flash style. A CTA (4 warps) takes ATTM_BQ = 64 query rows of one KV head, rows
// ordered as attn_prefill_d*'s (token i / G, head hk * G + i % G: a GQA group's heads share every K/V tile), and walks
// its key range in tiles of ATTM_BK = 64 keys: K copied to shared memory as it is stored, V transposed. Each warp owns
// 16 rows: S = Q K^T by mma.sync m16n8k16 (f16 in, f32 out; Q converted to f16 once, its fragments kept in
// registers), the masks (causal, sliding window) and the online softmax in f32 on the fragments, then O += P V by the
// same mma with P's f32 fragments repacked to f16 as the A operand (no shared memory for P). Rows' sums, splits of the
// key range (grid z) and their partials for attn_combine, sinks and paged caches: as attn_prefill_d*.
// Shared rows are padded by 8 halves, so the 8 rows a fragment load touches fall in distinct banks.
#ifdef ATTM_D
#define ATTM_BQ 64
#define ATTM_BK 64
#define ATTM_THREADS 128

__device__ __forceinline__ void mma_f16_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {  // lo in the low half
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <int D>
__device__ __forceinline__ void attn_mma_body(const float* __restrict__ q, const u8* __restrict__ kc,
                                              const u8* __restrict__ vc, const i32* __restrict__ pos,
                                              float* __restrict__ out, int n_tok, int n_head, int n_head_kv, int rbk,
                                              int rbv, int n_kv, float scale, int n_swa,
                                              const float* __restrict__ sinks, const i32* __restrict__ tables, int bs,
                                              int n_splits, float* __restrict__ part_ms,
                                              float* __restrict__ part_acc) {
    constexpr int BQ = ATTM_BQ, BK = ATTM_BK, QS = D + 8, VS = BK + 8, KC = D / 16, ND = D / 8;
    extern __shared__ float4 attm_smem4[];
    u16* sQ = (u16*)attm_smem4;  // [BQ][QS]
    u16* sK = sQ + BQ * QS;      // [BK][QS]
    u16* sVt = sK + BK * QS;     // [D][VS]: the value tile, transposed
    __shared__ int s_lo[BQ], s_hi[BQ], s_range[2];

    const int G = n_head / n_head_kv;
    const int hk = blockIdx.y;
    const int n_rows = n_tok * G;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

    prefill_row_masks<BQ>(pos, r0, n_rows, G, n_kv, n_swa, s_lo, s_hi, s_range);
    for (int task = tid; task < BQ * D / 4; task += ATTM_THREADS) {  // Q as f16, rows past the end zero
        const int r = task / (D / 4), d0 = (task % (D / 4)) * 4;
        const int gr = r0 + r;
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (gr < n_rows) a = *(const float4*)(q + ((size_t)(gr / G) * n_head + hk * G + gr % G) * D + d0);
        *(uint2*)(sQ + r * QS + d0) = make_uint2(pack_f16x2(a.x, a.y), pack_f16x2(a.z, a.w));
    }
    __syncthreads();
    const int kmin = s_range[0], kmax = s_range[1];
    const int ra = 16 * warp + g, rb = ra + 8;  // this lane's two rows of the tile
    const int lo_a = s_lo[ra], hi_a = s_hi[ra], lo_b = s_lo[rb], hi_b = s_hi[rb];
    u32 qa[KC][4];
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        qa[kc][0] = *(const u32*)(sQ + ra * QS + 16 * kc + 2 * t);
        qa[kc][1] = *(const u32*)(sQ + rb * QS + 16 * kc + 2 * t);
        qa[kc][2] = *(const u32*)(sQ + ra * QS + 16 * kc + 8 + 2 * t);
        qa[kc][3] = *(const u32*)(sQ + rb * QS + 16 * kc + 8 + 2 * t);
    }
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
    float o[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;

    const size_t kstride = (size_t)n_head_kv * rbk, vstride = (size_t)n_head_kv * rbv;
    const u8* kbase = kc + (size_t)hk * rbk;
    const u8* vbase = vc + (size_t)hk * rbv;
    const int2 keys = prefill_split_keys<BK>(kmin, kmax, n_splits);
    const int c_lo = keys.x, c_hi = keys.y;
    for (int c0 = c_lo; c0 < c_hi; c0 += BK) {  // CTA-uniform
        __syncthreads();  // the previous tile's sK and sVt are read
        for (int task = tid; task < BK * D / 8; task += ATTM_THREADS) {  // 8 halves of a key's row a task
            const int kk = task / (D / 8), d0 = (task % (D / 8)) * 8;
            const int c = c0 + kk;
            uint4 kv4 = make_uint4(0u, 0u, 0u, 0u), vv4 = make_uint4(0u, 0u, 0u, 0u);  // zeros past kmax (masked)
            if (c < kmax) {
                const long long cell = kv_cell(tables, 0, 0, bs, c);
                kv4 = *(const uint4*)(kbase + (size_t)cell * kstride + 2 * d0);
                vv4 = *(const uint4*)(vbase + (size_t)cell * vstride + 2 * d0);
            }
            *(uint4*)(sK + kk * QS + d0) = kv4;
            const u32 w[4] = {vv4.x, vv4.y, vv4.z, vv4.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                sVt[(d0 + 2 * j) * VS + kk] = (u16)(w[j] & 0xffffu);
                sVt[(d0 + 2 * j + 1) * VS + kk] = (u16)(w[j] >> 16);
            }
        }
        __syncthreads();

        float s[8][4];  // S fragments: keys 8 nb + 2t, + 1 of rows ra (0, 1) and rb (2, 3)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
            s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
            for (int kc2 = 0; kc2 < KC; ++kc2) {
                const u16* kr = sK + (8 * nb + g) * QS + 16 * kc2 + 2 * t;
                mma_f16_16816(s[nb], qa[kc2], *(const u32*)kr, *(const u32*)(kr + 8));
            }
        }
        float mx_a = NEG_INF, mx_b = NEG_INF;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int c = c0 + 8 * nb + 2 * t + j;
                s[nb][j] = (c >= lo_a && c < hi_a) ? s[nb][j] * scale : NEG_INF;
                s[nb][2 + j] = (c >= lo_b && c < hi_b) ? s[nb][2 + j] * scale : NEG_INF;
                mx_a = fmaxf(mx_a, s[nb][j]);
                mx_b = fmaxf(mx_b, s[nb][2 + j]);
            }
#pragma unroll
        for (int o2 = 1; o2 < 4; o2 <<= 1) {  // the 4 lanes of a row
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, o2));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, o2));
        }
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        const float al_a = mn_a == NEG_INF ? 1.0f : expf(m_a - mn_a);
        const float al_b = mn_b == NEG_INF ? 1.0f : expf(m_b - mn_b);
        float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                s[nb][j] = mn_a == NEG_INF ? 0.0f : expf(s[nb][j] - mn_a);  // masked: exp(-inf) = 0
                s[nb][2 + j] = mn_b == NEG_INF ? 0.0f : expf(s[nb][2 + j] - mn_b);
                sum_a += s[nb][j];
                sum_b += s[nb][2 + j];
            }
        l_a = l_a * al_a + sum_a;  // this lane's keys; summed over the row's 4 lanes at the end
        l_b = l_b * al_b + sum_b;
        m_a = mn_a;
        m_b = mn_b;
#pragma unroll
        for (int nd = 0; nd < ND; ++nd) {
            o[nd][0] *= al_a;
            o[nd][1] *= al_a;
            o[nd][2] *= al_b;
            o[nd][3] *= al_b;
        }
#pragma unroll
        for (int kc2 = 0; kc2 < BK / 16; ++kc2) {  // keys 16 kc2.. : P's fragments as the A operand
            const u32 pa[4] = {pack_f16x2(s[2 * kc2][0], s[2 * kc2][1]), pack_f16x2(s[2 * kc2][2], s[2 * kc2][3]),
                               pack_f16x2(s[2 * kc2 + 1][0], s[2 * kc2 + 1][1]),
                               pack_f16x2(s[2 * kc2 + 1][2], s[2 * kc2 + 1][3])};
#pragma unroll
            for (int nd = 0; nd < ND; ++nd) {
                const u16* vr = sVt + (8 * nd + g) * VS + 16 * kc2 + 2 * t;
                mma_f16_16816(o[nd], pa, *(const u32*)vr, *(const u32*)(vr + 8));
            }
        }
    }

#pragma unroll
    for (int o2 = 1; o2 < 4; o2 <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, o2);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, o2);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int gr = r0 + (half ? rb : ra);
        if (gr >= n_rows) continue;
        const float m = half ? m_b : m_a, l = half ? l_b : l_a;
        const size_t oh = (size_t)(gr / G) * n_head + hk * G + gr % G;
        if (n_splits > 1) {  // this split's (max, sum, unnormalized acc) for attn_combine
            const size_t ps = oh * n_splits + blockIdx.z;
            if (t == 0) {
                part_ms[ps * 2] = m;  // NEG_INF: no key of the row in this split (acc not written)
                part_ms[ps * 2 + 1] = l;
            }
            if (m != NEG_INF) {
#pragma unroll
                for (int nd = 0; nd < ND; ++nd)
                    *(float2*)(part_acc + ps * D + 8 * nd + 2 * t) = make_float2(o[nd][2 * half], o[nd][2 * half + 1]);
            }
            continue;
        }
        const float inv = sinks ? sink_inv(m, l, sinks, hk * G + gr % G) : (l > 0.0f ? 1.0f / l : 0.0f);
#pragma unroll
        for (int nd = 0; nd < ND; ++nd)
            *(float2*)(out + oh * D + 8 * nd + 2 * t) = make_float2(o[nd][2 * half] * inv, o[nd][2 * half + 1] * inv);
    }
}

#define ATTM_ENTRY(D)                                                                                             \
    extern "C" __global__ void __launch_bounds__(ATTM_THREADS) attn_mma_d##D(                                     \
        const float* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc,                        \
        const i32* __restrict__ pos, float* __restrict__ out, int n_tok, int n_head, int n_head_kv, int rbk,      \
        int rbv, int n_kv, float scale, int n_swa, int indirect, const float* __restrict__ sinks,                 \
        const i32* __restrict__ tables, int bs, int n_splits, float* __restrict__ part_ms,                        \
        float* __restrict__ part_acc) {                                                                           \
        if (indirect) {                                                                                           \
            kc = *(const u8* const*)kc;                                                                           \
            vc = *(const u8* const*)vc;                                                                           \
        }                                                                                                         \
        attn_mma_body<D>(q, kc, vc, pos, out, n_tok, n_head, n_head_kv, rbk, rbv, n_kv, scale, n_swa, sinks,      \
                         tables, bs, n_splits, part_ms, part_acc);                                                \
    }
#define ATTM_ENTRY_X(D) ATTM_ENTRY(D)
ATTM_ENTRY_X(ATTM_D)
#endif
