// kv.cu: writing K/V rows into the cache in its ggml layout. Cell c of a layer's cache holds position c; a cell
// is n_head_kv rows of row_bytes. f32 as is, f16 rounded to nearest even; q8_0 / q4_0 blocks of 32 along
// head_dim as ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref (block_q8_0: d fp16, qs[32] int8;
// block_q4_0: d fp16, qs[16], element j in the low nibble and j + 16 in the high nibble of qs[j]).
// Products and sums that the reference rounds separately use __fmul_rn / __fadd_rn (no FMA contraction).
// indirect != 0: dst is the device address of a slot holding the cache's address (CUDA graphs replayed over
// another cache of the same shape rewrite the slot, not the graph). tables != nullptr: a paged cache, token t of
// sequence seq_of[t] (0 without seq_of) written to cell kv_cell(tables, seq_of[t], tbl_w, bs, pos[t]).

// x (n_tok, n_head_kv, hd) f32 -> rows of f32 (code 0) or f16 (code 1): element i of x (one thread each)
__device__ __forceinline__ void kv_store_float_at(long long i, const float* __restrict__ x, const i32* __restrict__ pos,
                                                  u8* dst, int n_tok, int n_head_kv, int hd, int code,
                                                  const i32* __restrict__ tables, const i32* __restrict__ seq_of,
                                                  int tbl_w, int bs) {
    if (i >= (long long)n_tok * n_head_kv * hd) return;
    const int j = (int)(i % hd);
    const long long th = i / hd;  // t * n_head_kv + h
    const int h = (int)(th % n_head_kv), t = (int)(th / n_head_kv);
    const long long row = kv_cell(tables, seq_of ? seq_of[t] : 0, tbl_w, bs, pos[t]) * n_head_kv + h;
    if (code == 0) ((float*)dst)[row * hd + j] = x[i];
    else ((u16*)dst)[row * hd + j] = f2h(x[i]);
}

// one warp per block of 32 values: lane j of thread i's warp holds element j (i = the thread's element count as
// kv_store_float_at's, so one grid serves both). code 2 = q8_0, 3 = q4_0
__device__ __forceinline__ void kv_store_quant_at(long long i, const float* __restrict__ x, const i32* __restrict__ pos,
                                                  u8* dst, int n_tok, int n_head_kv, int hd, int code,
                                                  const i32* __restrict__ tables, const i32* __restrict__ seq_of,
                                                  int tbl_w, int bs) {
    const int lane = threadIdx.x & 31;
    const long long blk = i >> 5;
    const int nb = hd >> 5;  // blocks per row
    if (blk >= (long long)n_tok * n_head_kv * nb) return;  // whole warps leave together
    const int b = (int)(blk % nb);
    const long long th = blk / nb;
    const int h = (int)(th % n_head_kv), t = (int)(th / n_head_kv);
    const float v = x[th * hd + b * 32 + lane];
    const long long row = kv_cell(tables, seq_of ? seq_of[t] : 0, tbl_w, bs, pos[t]) * n_head_kv + h;
    if (code == 2) {
        u8* o = dst + row * (nb * 34) + b * 34;
        const float amax = warp_max(fabsf(v));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const int q = (int)roundf(__fmul_rn(v, id));
        o[2 + lane] = (u8)(i8)q;
        if (lane == 0) *(u16*)o = f2h(d);
    } else {
        u8* o = dst + row * (nb * 18) + b * 18;
        // the value of largest magnitude, the first one on ties (as the reference's strict `<` scan)
        float best = fabsf(v);
        int bi = lane;
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, s);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, s);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
            }
        }
        float vmax = __shfl_sync(0xffffffffu, v, bi);
        if (best == 0.0f) vmax = 0.0f;  // reference: vmax stays +0.0 when no |v| > 0
        const float d = vmax / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const int q = min(15, (int)__fadd_rn(__fmul_rn(v, id), 8.5f));
        const int q_hi = __shfl_down_sync(0xffffffffu, q, 16);
        if (lane < 16) o[2 + lane] = (u8)(q | (q_hi << 4));
        if (lane == 0) *(u16*)o = f2h(d);
    }
}

// k and v of a layer in one launch: blockIdx.y 0 stores xk into dk, 1 xv into dv, each as its code says (f32/f16 one
// thread an element, q8_0/q4_0 one warp a block); the grid covers n_tok n_head_kv max(hd_k, hd_v) threads a row of
// it. indirect != 0: dk, dv are the device addresses of slots holding the caches' addresses.
extern "C" __global__ void kv_store_kv(const float* __restrict__ xk, const float* __restrict__ xv,
                                       const i32* __restrict__ pos, u8* dk, u8* dv, int n_tok, int n_head_kv, int hd_k,
                                       int hd_v, int code_k, int code_v, int indirect,
                                       const i32* __restrict__ tables, const i32* __restrict__ seq_of, int tbl_w,
                                       int bs) {
    const bool is_v = blockIdx.y == 1;
    const float* x = is_v ? xv : xk;
    u8* dst = is_v ? dv : dk;
    const int hd = is_v ? hd_v : hd_k, code = is_v ? code_v : code_k;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tok * n_head_kv * hd) return;
    if (indirect) dst = *(u8* const*)dst;
    if (code <= 1) kv_store_float_at(i, x, pos, dst, n_tok, n_head_kv, hd, code, tables, seq_of, tbl_w, bs);
    else kv_store_quant_at(i, x, pos, dst, n_tok, n_head_kv, hd, code, tables, seq_of, tbl_w, bs);
}
