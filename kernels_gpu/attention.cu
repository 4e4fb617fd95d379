// attention.cu: causal attention of a batch of queries over one layer's KV cache, flash style (online softmax,
// no score matrix), reading the cache rows in their stored type: code 0 f32, 1 f16, 2 q8_0, 3 q4_0
// (block_q8_0: d fp16, qs[32] int8; block_q4_0: d fp16, qs[16] nibbles, element j low / j + 16 high of qs[j]).
// Masks: key c is visible to a query at position p iff c <= p and (n_swa == 0 or p - c < n_swa).
// Attention sinks (gpt-oss; sinks != nullptr): head h's logit sinks[h] joins the softmax's sum (no value row), as
// ggml's flash attention folds it in after the last key: out = A / (S + exp(sink - M)) with the max M raised to the
// sink where it is above (sink_inv). sinks == nullptr keeps the plain A / S.
//
// A CTA (4 warps) takes one token, HPC query heads of one GQA group (which share the K/V rows) and one split
// of the keys; lane l holds elements [l*E, l*E + E) of a row (head_dim = 32 E). Each warp runs its own online
// softmax over every 4th group of U keys; the 4 warps are merged through shared memory. With several splits
// the partial (max, sum, acc) go to a workspace and attn_combine merges them (flash-decoding).
// chunk <= 0 asks for a dynamic split: chunk = max(-chunk, ceil(n_eff / n_splits)) with n_eff read from the
// positions on the device, so a CUDA graph captured once (grid fixed by the cache size) serves every position.
// Paged caches (tables != nullptr): key c of token t lives in cell kv_cell(tables, s, tbl_w, bs, c), s = seq_of[t]
// (0 without seq_of). With seq_of the tokens may belong to different sequences (a ragged decode batch): each token
// attends to its own sequence's keys up to its position, and a dynamic split sizes its chunks from that position.

#define ATT_WARPS 4

// 1 / the softmax denominator of a row (running max M, sum S) with head h's sink logit folded in, times the factor
// its accumulator A needs when the sink raises the max: out = A * sink_inv(...). 0 for a row that saw no key.
__device__ __forceinline__ float sink_inv(float M, float S, const float* __restrict__ sinks, int h) {
    if (!(S > 0.0f) || M == NEG_INF) return 0.0f;
    const float sk = sinks[h];
    if (sk > M) {
        const float f = expf(M - sk);
        return f / (S * f + 1.0f);
    }
    return 1.0f / (S + expf(sk - M));
}

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
                                          float scale, int n_swa, const float* __restrict__ sinks,
                                          const i32* __restrict__ tables, const i32* __restrict__ seq_of, int tbl_w,
                                          int bs) {
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
        // one sequence: positions ascend, the last token sees the most; a ragged batch: each token its own
        const int n_eff = min(n_kv, (seq_of ? pos[t] : pos[gridDim.z - 1]) + 1);
        chunk = max(-chunk, (n_eff + n_splits - 1) / n_splits);
    }
    const int sq = seq_of ? seq_of[t] : 0;
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
            const long long cc = kv_cell(tables, sq, tbl_w, bs, min(c + u, c1 - 1));  // a valid row; masked below
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
            if (sinks) {
                out[oh * D + j] = A * sink_inv(M, S, sinks, h0 + g);
            } else {
                out[oh * D + j] = S > 0.0f ? A / S : 0.0f;
            }
        } else {
            part_acc[(oh * n_splits + split) * D + j] = A;
            if (j == 0) {
                part_ms[(oh * n_splits + split) * 2] = M;
                part_ms[(oh * n_splits + split) * 2 + 1] = S;
            }
        }
    }
}

// merge the splits of one (token, head): grid n_tok * n_head, D threads; sinks (n_head,) or nullptr. xq, xm (or
// nullptr): the output also quantized as quantize_q8_1 (matvec_q8.cu) for the q8 matvec that reads it next (the
// output projection), a warp a block of 32 (D % 32 == 0).
extern "C" __global__ void attn_combine(const float* __restrict__ part_ms, const float* __restrict__ part_acc,
                                        float* __restrict__ out, int n_splits, int D,
                                        const float* __restrict__ sinks, int n_head, i8* __restrict__ xq,
                                        float4* __restrict__ xm) {
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
    float o;
    if (sinks) {
        o = A * sink_inv(M, S, sinks, (int)(oh % n_head));
    } else {
        o = S > 0.0f ? A / S : 0.0f;
    }
    const size_t i = oh * D + j;
    out[i] = o;
    if (xq) q8_block_store(o, xq, xm, i);  // D % 32 == 0: a warp holds whole blocks
}

#define ATTN_ENTRY(E, HPC)                                                                                    \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * WARP) attn_e##E##_h##HPC(                        \
        const float* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc,                    \
        const i32* __restrict__ pos, float* __restrict__ out, float* __restrict__ part_ms,                    \
        float* __restrict__ part_acc, int n_head, int n_head_kv, int code_k, int code_v, int rbk, int rbv,    \
        int n_kv, int chunk, int n_splits, float scale, int n_swa, int indirect,                               \
        const float* __restrict__ sinks, const i32* __restrict__ tables, const i32* __restrict__ seq_of,      \
        int tbl_w, int bs) {                                                                                  \
        if (indirect) { /* kc, vc: slots holding the cache's addresses (graph replays over another cache) */  \
            kc = *(const u8* const*)kc;                                                                       \
            vc = *(const u8* const*)vc;                                                                       \
        }                                                                                                     \
        attn_body<E, HPC>(q, kc, vc, pos, out, part_ms, part_acc, n_head, n_head_kv, code_k, code_v, rbk, rbv, \
                          n_kv, chunk, n_splits, scale, n_swa, sinks, tables, seq_of, tbl_w, bs);             \
    }

// One kernel per compiled module: attention.py builds the module with -DATT_E=E -DATT_HPC=HPC for the variant a
// layer needs (head_dim = 32 E; HPC * E <= 32 keeps the accumulators in registers), so only used variants compile.
#define ATTN_ENTRY_X(E, HPC) ATTN_ENTRY(E, HPC)
#ifdef ATT_E
ATTN_ENTRY_X(ATT_E, ATT_HPC)
#endif

// A prefill CTA's BQ query rows r0.. (row r of token r / G): each row's key mask [lo, hi) (causal, sliding window;
// empty past n_rows) in s_lo / s_hi, and in s_range the union of the non-empty ones ([INT_MAX, 0) if none). Called
// by every thread of the CTA (attn_prefill_d*, attn_mma_d*); the caller synchronizes before reading the results.
template <int BQ>
__device__ __forceinline__ void prefill_row_masks(const i32* __restrict__ pos, int r0, int n_rows, int G, int n_kv,
                                                  int n_swa, int* s_lo, int* s_hi, int* s_range) {
    const int tid = threadIdx.x;
    if (tid == 0) {
        s_range[0] = 0x7fffffff;
        s_range[1] = 0;
    }
    __syncthreads();
    if (tid < BQ) {
        const int r = r0 + tid;
        int lo = 0, hi = 0;  // an empty mask for rows past the end
        if (r < n_rows) {
            const int p = pos[r / G];
            lo = n_swa > 0 ? max(0, p - n_swa + 1) : 0;
            hi = min(p, n_kv - 1) + 1;
            if (hi > lo) {
                atomicMin(&s_range[0], lo);
                atomicMax(&s_range[1], hi);
            }
        }
        s_lo[tid] = lo;
        s_hi[tid] = hi;
    }
}

// The keys [x, y) of split blockIdx.z of n_splits of a prefill CTA's key range [kmin, kmax): whole tiles of BK keys
// from kmin (none past kmax: the rows' masks end there); empty for a split past the range.
template <int BK>
__device__ __forceinline__ int2 prefill_split_keys(int kmin, int kmax, int n_splits) {
    const int per = ((kmax - kmin + n_splits - 1) / n_splits + BK - 1) / BK * BK;
    const int lo = kmin + (int)blockIdx.z * per;
    return make_int2(lo, min(kmax, lo + per));
}

// ---- prefill: query tiles x key tiles in shared memory (built with -DATTP_D=head_dim, a multiple of 64, <= 256)
// A CTA (256 threads, 16 x 16) takes ATTP_BQ = 64 query rows of one KV head: row i of the (token, head of the GQA
// group) pairs in order, token i / G, head hk * G + i % G, so the heads of a group share every K/V tile. Per tile
// of ATTP_BK = 64 keys the cache rows are dequantized to float in shared memory (K transposed), thread (ty, tx)
// computes the 4 x 4 scores of rows ty*4.. and keys tx*4.., runs the online softmax of its 4 rows (max over the 16
// threads of a row by shuffles), writes its probabilities to shared memory and accumulates rows ty*4.. x columns
// tx*4 + 64 j of P V in fp32 registers. The key range of a CTA is the union of its rows' masks; each score is masked
// by its own row's (causal, sliding window). CTAs are issued last row tile first (the most keys, when positions
// ascend). Sums run in another order than attn_e*'s (fp32 either way). A paged cache: every row is of the one
// sequence whose block table `tables` is (key c in cell kv_cell(tables, 0, 0, bs, c)).
// n_splits > 1 (grid z): few row tiles over many keys (a prompt chunk late in a long context) would leave most SMs
// idle, so each CTA takes a share of the tile's key range, whole key tiles, and writes its rows' partial (max, sum,
// unnormalized P V) for attn_combine, as the decode kernel's splits do.
#ifdef ATTP_D
#define ATTP_BQ 64
#define ATTP_BK 64
#define ATTP_THREADS 256

// elements [e0, e0 + 8) of a cache row of type `code` as float32 (e0 a multiple of 8; f32/f16 rows 16-byte aligned)
__device__ __forceinline__ void load_chunk8(int code, const u8* __restrict__ row, int e0, float (&v)[8]) {
    if (code == 0) {
        const float4 a = *(const float4*)((const float*)row + e0), b = *(const float4*)((const float*)row + e0 + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else if (code == 1) {
        const uint4 a = *(const uint4*)((const u16*)row + e0);
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = h2f((u16)(w[k] & 0xffffu));
            v[2 * k + 1] = h2f((u16)(w[k] >> 16));
        }
    } else if (code == 2) {
        const u8* blk = row + (e0 >> 5) * 34;
        const float d = ld_f16(blk);
        const u8* qs = blk + 2 + (e0 & 31);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = (float)(i8)qs[k] * d;
    } else {
        const u8* blk = row + (e0 >> 5) * 18;
        const float d = ld_f16(blk);
        const int o = e0 & 31;
        const u8* qs = blk + 2 + (o & 15);
        const bool high = o >= 16;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const u32 b = qs[k];
            const int qv = (int)(high ? (b >> 4) : (b & 15u)) - 8;
            v[k] = d * (float)qv;
        }
    }
}

template <int D>
__device__ __forceinline__ void attn_prefill_body(const float* __restrict__ q, const u8* __restrict__ kc,
                                                  const u8* __restrict__ vc, const i32* __restrict__ pos,
                                                  float* __restrict__ out, int n_tok, int n_head, int n_head_kv,
                                                  int code_k, int code_v, int rbk, int rbv, int n_kv, float scale,
                                                  int n_swa, const float* __restrict__ sinks,
                                                  const i32* __restrict__ tables, int bs, int n_splits,
                                                  float* __restrict__ part_ms, float* __restrict__ part_acc) {
    constexpr int BQ = ATTP_BQ, BK = ATTP_BK, NJ = D / 64, PS = BK + 4;  // PS: sP row stride
    constexpr int KREG = D * BK > BQ * PS ? D * BK : BQ * PS;
    extern __shared__ float4 attp_smem4[];
    float* sQt = (float*)attp_smem4;  // [D][BQ]: the query tile, transposed
    float* sKt = sQt + D * BQ;         // [D][BK]: the key tile, transposed; then sP [BQ][PS], the probabilities
    float* sP = sKt;
    float* sV = sKt + KREG;            // [BK][D]: the value tile
    __shared__ int s_lo[BQ], s_hi[BQ], s_range[2];

    const int G = n_head / n_head_kv;
    const int hk = blockIdx.y;
    const int n_rows = n_tok * G;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;

    prefill_row_masks<BQ>(pos, r0, n_rows, G, n_kv, n_swa, s_lo, s_hi, s_range);
    for (int task = tid; task < BQ * D / 4; task += ATTP_THREADS) {  // lanes: consecutive rows
        const int r = task % BQ, d0 = (task / BQ) * 4;
        const int gr = r0 + r;
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (gr < n_rows) a = *(const float4*)(q + ((size_t)(gr / G) * n_head + hk * G + gr % G) * D + d0);
        sQt[(d0 + 0) * BQ + r] = a.x;
        sQt[(d0 + 1) * BQ + r] = a.y;
        sQt[(d0 + 2) * BQ + r] = a.z;
        sQt[(d0 + 3) * BQ + r] = a.w;
    }
    __syncthreads();
    const int kmin = s_range[0], kmax = s_range[1];
    int lo[4], hi[4];
    float m[4], l[4], acc[4][NJ * 4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        lo[i] = s_lo[ty * 4 + i];
        hi[i] = s_hi[ty * 4 + i];
        m[i] = NEG_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < NJ * 4; ++e) acc[i][e] = 0.0f;
    }

    const size_t kstride = (size_t)n_head_kv * rbk, vstride = (size_t)n_head_kv * rbv;
    const u8* kbase = kc + (size_t)hk * rbk;
    const u8* vbase = vc + (size_t)hk * rbv;
    const int2 keys = prefill_split_keys<BK>(kmin, kmax, n_splits);
    const int c_lo = keys.x, c_hi = keys.y;
    for (int c0 = c_lo; c0 < c_hi; c0 += BK) {  // CTA-uniform
        __syncthreads();  // the previous tile's sP and sV are read
        for (int task = tid; task < BK * D / 8; task += ATTP_THREADS) {  // K, lanes: consecutive keys
            const int kk = task % BK, d0 = (task / BK) * 8;
            const int c = c0 + kk;
            float v[8];
            if (c < kmax) {
                load_chunk8(code_k, kbase + (size_t)kv_cell(tables, 0, 0, bs, c) * kstride, d0, v);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = 0.0f;
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) sKt[(d0 + j) * BK + kk] = v[j];
        }
        for (int task = tid; task < BK * D / 8; task += ATTP_THREADS) {  // V, lanes: consecutive chunks of a row
            const int kk = task / (D / 8), d0 = (task % (D / 8)) * 8;
            const int c = c0 + kk;
            float v[8];
            if (c < kmax) {
                load_chunk8(code_v, vbase + (size_t)kv_cell(tables, 0, 0, bs, c) * vstride, d0, v);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = 0.0f;  // zeros, not stale values: p = 0 times NaN is NaN
            }
            *(float4*)(sV + kk * D + d0) = make_float4(v[0], v[1], v[2], v[3]);
            *(float4*)(sV + kk * D + d0 + 4) = make_float4(v[4], v[5], v[6], v[7]);
        }
        __syncthreads();

        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) s[i][j] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
            const float4 qa = *(const float4*)(sQt + d * BQ + ty * 4);
            const float4 ka = *(const float4*)(sKt + d * BK + tx * 4);
            const float qv[4] = {qa.x, qa.y, qa.z, qa.w}, kv[4] = {ka.x, ka.y, ka.z, ka.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
        }
        __syncthreads();  // every score is read from sKt: sP may overwrite it

#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float tmax = NEG_INF;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = c0 + tx * 4 + j;
                s[i][j] = (c >= lo[i] && c < hi[i]) ? s[i][j] * scale : NEG_INF;
                tmax = fmaxf(tmax, s[i][j]);
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));  // 16 lanes
            const float m_new = fmaxf(m[i], tmax);
            float alpha = 1.0f, p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (m_new != NEG_INF) {  // else no key of this row yet: acc and l stay 0
                alpha = expf(m[i] - m_new);
#pragma unroll
                for (int j = 0; j < 4; ++j) p[j] = expf(s[i][j] - m_new);
            }
            l[i] = l[i] * alpha + ((p[0] + p[1]) + (p[2] + p[3]));  // this thread's keys; summed over tx at the end
#pragma unroll
            for (int e = 0; e < NJ * 4; ++e) acc[i][e] *= alpha;
            m[i] = m_new;
            *(float4*)(sP + (ty * 4 + i) * PS + tx * 4) = make_float4(p[0], p[1], p[2], p[3]);
        }
        __syncthreads();

#pragma unroll 2
        for (int k = 0; k < BK; k += 4) {
            float pr[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 a = *(const float4*)(sP + (ty * 4 + i) * PS + k);
                pr[i][0] = a.x; pr[i][1] = a.y; pr[i][2] = a.z; pr[i][3] = a.w;
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int jj = 0; jj < NJ; ++jj) {
                    const float4 vv = *(const float4*)(sV + (k + kk) * D + jj * 64 + tx * 4);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc[i][jj * 4 + 0] = fmaf(pr[i][kk], vv.x, acc[i][jj * 4 + 0]);
                        acc[i][jj * 4 + 1] = fmaf(pr[i][kk], vv.y, acc[i][jj * 4 + 1]);
                        acc[i][jj * 4 + 2] = fmaf(pr[i][kk], vv.z, acc[i][jj * 4 + 2]);
                        acc[i][jj * 4 + 3] = fmaf(pr[i][kk], vv.w, acc[i][jj * 4 + 3]);
                    }
                }
        }
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float ls = l[i];
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, o);
        const int gr = r0 + ty * 4 + i;
        if (gr < n_rows && n_splits > 1) {  // this split's (max, sum, unnormalized acc) for attn_combine
            const size_t ps = ((size_t)(gr / G) * n_head + hk * G + gr % G) * n_splits + blockIdx.z;
            if (tx == 0) {
                part_ms[ps * 2] = m[i];  // NEG_INF: no key of the row in this split (acc not written)
                part_ms[ps * 2 + 1] = ls;
            }
            if (m[i] != NEG_INF) {
#pragma unroll
                for (int jj = 0; jj < NJ; ++jj)
                    *(float4*)(part_acc + ps * D + jj * 64 + tx * 4) = make_float4(
                        acc[i][jj * 4 + 0], acc[i][jj * 4 + 1], acc[i][jj * 4 + 2], acc[i][jj * 4 + 3]);
            }
        } else if (gr < n_rows) {
            float* orow = out + ((size_t)(gr / G) * n_head + hk * G + gr % G) * D;
            if (sinks) {  // m[i]: the row's max (reduced over its 16 lanes), ls: its sum
                const float inv = sink_inv(m[i], ls, sinks, hk * G + gr % G);
#pragma unroll
                for (int jj = 0; jj < NJ; ++jj) {
                    const float4 a = make_float4(acc[i][jj * 4 + 0] * inv, acc[i][jj * 4 + 1] * inv,
                                                 acc[i][jj * 4 + 2] * inv, acc[i][jj * 4 + 3] * inv);
                    *(float4*)(orow + jj * 64 + tx * 4) = a;
                }
                continue;
            }
#pragma unroll
            for (int jj = 0; jj < NJ; ++jj) {
                float4 a;
                a.x = ls > 0.0f ? acc[i][jj * 4 + 0] / ls : 0.0f;
                a.y = ls > 0.0f ? acc[i][jj * 4 + 1] / ls : 0.0f;
                a.z = ls > 0.0f ? acc[i][jj * 4 + 2] / ls : 0.0f;
                a.w = ls > 0.0f ? acc[i][jj * 4 + 3] / ls : 0.0f;
                *(float4*)(orow + jj * 64 + tx * 4) = a;
            }
        }
    }
}

#define ATTP_ENTRY(D, MINB)                                                                                     \
    extern "C" __global__ void __launch_bounds__(ATTP_THREADS, MINB) attn_prefill_d##D(                        \
        const float* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc,                      \
        const i32* __restrict__ pos, float* __restrict__ out, int n_tok, int n_head, int n_head_kv, int code_k, \
        int code_v, int rbk, int rbv, int n_kv, float scale, int n_swa, int indirect,                          \
        const float* __restrict__ sinks, const i32* __restrict__ tables, int bs, int n_splits,                  \
        float* __restrict__ part_ms, float* __restrict__ part_acc) {                                            \
        if (indirect) {                                                                                         \
            kc = *(const u8* const*)kc;                                                                         \
            vc = *(const u8* const*)vc;                                                                         \
        }                                                                                                       \
        attn_prefill_body<D>(q, kc, vc, pos, out, n_tok, n_head, n_head_kv, code_k, code_v, rbk, rbv, n_kv,     \
                             scale, n_swa, sinks, tables, bs, n_splits, part_ms, part_acc);                     \
    }
#define ATTP_ENTRY_X(D, MINB) ATTP_ENTRY(D, MINB)
ATTP_ENTRY_X(ATTP_D, (ATTP_D <= 128 ? 2 : 1))
#endif
