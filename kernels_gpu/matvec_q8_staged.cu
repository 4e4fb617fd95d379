// matvec_q8_staged.cu (after matvec_q8.cu): the one-token q8 matvec of block_q6_K with the weights staged through
// shared memory. A 210-byte block is only 2-byte aligned, so reading it in place (Q6K8::load) takes 4-byte loads
// that a warp spreads over 8 blocks, each sector fetched several times (and from L2: weights skip L1). Here a warp
// copies 8 whole blocks of a row (1680 bytes, a whole number of 16-byte pieces) with 16-byte cp.async from the
// 16-byte aligned span around them, every byte fetched once and fully coalesced, double-buffered so the next
// chunk streams in while this one is dotted; the dot products then read shared memory (Q6K8::dot, dp4a).
// Lane l dots part l % 4 of block l / 4 of the chunk against the q8 activations (loaded once for the RPW rows).

#ifndef Q6S_WARPS
#define Q6S_WARPS 4  // warps per CTA (128 threads): 2 buffers x 2 rows x 1696 bytes a warp stay under 48 KiB
#endif
#define Q6S_NB 8                      // blocks a chunk: 8 x 210 = 1680 bytes = 105 x 16
#define Q6S_SPAN (Q6S_NB * 210 + 16)  // bytes staged a chunk: from (start & ~15), up to 14 before the start

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
// 16 bytes global -> shared, asynchronously, through L2 only (.cg: the weights stream once)
__device__ __forceinline__ void cp_async16(void* s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(s)), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// bytes [a, a + n) of global memory (a even) into s, 16-byte aligned, as the aligned 16-byte pieces that hold
// them: the data starts at s + (a & 15). A 16-byte aligned piece holding a valid byte never crosses a page, so the
// up to 14 bytes read before a and 15 after a + n cannot fault (they are never used).
__device__ __forceinline__ void stage_span(u8* s, const u8* a, int n, int lane) {
    const size_t a16 = (size_t)a & ~(size_t)15;
    const int pieces = (int)(((size_t)a + n + 15 - a16) >> 4);  // <= Q6S_SPAN / 16
    for (int j = lane; j < pieces; j += WARP) cp_async16(s + 16 * j, (const u8*)(a16 + 16 * j));
}

// 16 bytes at byte offset o (even) of the 16-byte aligned shared buffer s4, as 5 aligned words (fix16 shifts them
// into place); indexing the buffer (not a cast address) keeps the loads in the shared space (ld.shared)
__device__ __forceinline__ U16B lds16_a2(const u32* s4, u32 o) {
    U16B r;
#pragma unroll
    for (int i = 0; i < 5; ++i) r.w[i] = s4[(o >> 2) + i];
    return r;
}

// Q6K8's part p of the block_q6_K at byte offset o (even) of the staged chunk s: the fields Q6K8::load reads
__device__ __forceinline__ Q6K8::W q6k_load_staged(const u8* s, u32 o, int p) {
    const u32 h = p >> 1, l0 = 16 * (p & 1);
    const u32* s4 = (const u32*)s;
    Q6K8::W w;
    w.lo = lds16_a2(s4, o + h * 64 + l0);
    w.hi = lds16_a2(s4, o + h * 64 + 32 + l0);
    w.qh = lds16_a2(s4, o + 128 + h * 32 + l0);
    w.sc01 = ld_u32_a2(s + o + 192 + h * 8);
    w.sc23 = ld_u32_a2(s + o + 192 + h * 8 + 4);
    w.d = ld_u16(s + o + 208);
    w.sh = 8u * (o & 3u);  // every field offset above is a multiple of 16: one shift for all three
    return w;
}

// y[row] for RPW rows a warp, `wpr` warps a row group (each takes every wpr-th chunk of 8 blocks; reduced through
// shared memory); `cta` is the CTA's index within this matrix. Rows past the end re-read the group's last row.
template <int RPW>
__device__ __forceinline__ void matvec_q8s_q6k_body(int cta, const u8* __restrict__ w, const i8* __restrict__ xq,
                                                    const float4* __restrict__ xm, float* __restrict__ y,
                                                    int n_out, int n_blocks, int wpr) {
    __shared__ __align__(16) u8 stage[Q6S_WARPS][2][RPW][Q6S_SPAN];
    __shared__ float red[Q6S_WARPS][RPW];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (cta * (Q6S_WARPS / wpr) + warp / wpr) * RPW;
    const int sub = warp % wpr;
    const size_t row_bytes = (size_t)n_blocks * 210;
    const int nr = min(RPW, n_out - row0);
    float acc[RPW];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) acc[rr] = 0.0f;
    if (nr > 0) {
        const int n_chunks = (n_blocks + Q6S_NB - 1) / Q6S_NB;
        const u8* wr[RPW];
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) wr[rr] = w + (size_t)(row0 + (rr < nr ? rr : nr - 1)) * row_bytes;
        if (sub < n_chunks) {
            const int b0 = sub * Q6S_NB, n = min(Q6S_NB, n_blocks - b0) * 210;
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr) stage_span(stage[warp][0][rr], wr[rr] + (size_t)b0 * 210, n, lane);
        }
        cp_async_commit();
        int buf = 0;
        for (int c = sub; c < n_chunks; c += wpr, buf ^= 1) {
            // the next chunk into the other buffer (read last iteration, released by its closing __syncwarp)
            if (c + wpr < n_chunks) {
                const int b0 = (c + wpr) * Q6S_NB, n = min(Q6S_NB, n_blocks - b0) * 210;
#pragma unroll
                for (int rr = 0; rr < RPW; ++rr)
                    stage_span(stage[warp][buf ^ 1][rr], wr[rr] + (size_t)b0 * 210, n, lane);
            }
            cp_async_commit();  // possibly empty: one group an iteration keeps the count below uniform
            cp_async_wait<1>();  // this lane's copies of chunk c are in
            __syncwarp();        // ... and every lane's
            const int b = c * Q6S_NB + (lane >> 2), p = lane & 3;
            if (b < n_blocks) {
                const Q6K8::X xv = Q6K8::loadx(xq, xm, b, p);
#pragma unroll
                for (int rr = 0; rr < RPW; ++rr) {
                    const u32 off = (u32)((size_t)(wr[rr] + (size_t)c * Q6S_NB * 210) & 15u);
                    const Q6K8::W wv = q6k_load_staged(stage[warp][buf][rr], off + 210 * (lane >> 2), p);
                    acc[rr] += Q6K8::dot(wv, xv, p);
                }
            }
            __syncwarp();  // every lane is done with this buffer before it is refilled
        }
        cp_async_wait<0>();
    }
    q8_store_rows<RPW>(acc, red, warp, lane, sub, wpr, nr, y, row0);
}

// up to three Q6_K matrices in one launch (the CTA picks its matrix as matvec_q8m_*); one matrix: c1 = c2 = grid
#define Q8S_ENTRY(R)                                                                                         \
    extern "C" __global__ void __launch_bounds__(Q6S_WARPS * 32) matvec_q8s_q6_k_r##R(MVQ8M_ARGS) {          \
        const Q8Pick m = q8_pick(w0, w1, w2, y0, y1, y2, n0, n1, n2, c1, c2);                                \
        matvec_q8s_q6k_body<R>(m.cta, m.w, xq, xm, m.y, m.n_out, n_blocks, wpr);                             \
    }
Q8S_ENTRY(1)
Q8S_ENTRY(2)

// MoE: the staged Q6_K kernel over selected experts, with matvec_q8id's grid and arguments
#define Q8SID_ENTRY(R)                                                                                       \
    extern "C" __global__ void __launch_bounds__(Q6S_WARPS * 32) matvec_q8sid_q6_k_r##R(MVQ8ID_ARGS) {       \
        const Q8Id m = q8_id_pick<256>(w0, w1, y0, y1, ids, expert_bytes, n_out, xq, xm, x_div, n_blocks, wpr); \
        matvec_q8s_q6k_body<R>(blockIdx.x, m.w, m.xq, m.xm, m.y, n_out, n_blocks, wpr);                     \
    }
Q8SID_ENTRY(2)
