// common.cu: prepended (as text) to every kernels_gpu module before NVRTC compiles it (see module.py).
// No #include: NVRTC has no standard headers, so integer types and fp16 conversions are defined here.
// All block layouts follow ggml-common.h; fp16 fields are read as raw bits and converted with PTX cvt.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

#define WARP 32
#define NEG_INF (__int_as_float(0xff800000))

// The KV-cache cell of position p of sequence s: through a paged cache's block tables (n_seq, tbl_w) of block ids,
// cell tables[s][p / bs] * bs + p % bs; without tables (nullptr, a contiguous cache) the cell is p.
__device__ __forceinline__ long long kv_cell(const i32* __restrict__ tables, int s, int tbl_w, int bs, int p) {
    return tables ? (long long)tables[(long long)s * tbl_w + p / bs] * bs + p % bs : (long long)p;
}

// IEEE half bits -> float32 (exact)
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// float32 -> IEEE half bits, round to nearest even (as GGML_FP32_TO_FP16 and numpy)
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

// little-endian loads at the alignment a block field guarantees
__device__ __forceinline__ u16 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {  // 2-byte aligned
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}
__device__ __forceinline__ u32 ld_u32(const u8* p) { return *(const u32*)p; }  // 4-byte aligned
__device__ __forceinline__ float ld_f16(const u8* p) { return h2f(ld_u16(p)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// quantize_q8_1 (matvec_q8.cu) of one block of 32 values held one a lane by a whole warp: element i of the
// quantized array (i % 32 == the lane) gets xq[i] = rint(v / d), d = max|v| / 127 (0 for an all-zero block), and
// lane 0 writes xm[i / 32] = (d, sum q[0..15], sum q[16..31], 0). Every lane of the warp must call it.
template <typename I>  // the index type of the caller (int or size_t)
__device__ __forceinline__ void q8_block_store(float v, i8* __restrict__ xq, float4* __restrict__ xm, I i) {
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const int q = amax == 0.0f ? 0 : __float2int_rn(v / d);
    xq[i] = (i8)q;
    float s = (float)q;  // exact: |sum| <= 16 * 127
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float s_hi = __shfl_sync(0xffffffffu, s, 16);
    if ((threadIdx.x & 31) == 0) xm[i >> 5] = make_float4(d, s, s_hi, 0.0f);
}

// act(gate) * up of a GLU: act 0 silu, 1 gelu (tanh approximation, ggml_gelu), 2 gpt-oss's clamped SwiGLU
// (ggml_compute_forward_swiglu_oai: x = min(gate, 7), x / (1 + exp(-1.702 x)) * (clamp(up, -7, 7) + 1))
__device__ __forceinline__ float glu_act(float g, float u, int act) {
    if (act == 0) return g / (1.0f + expf(-g)) * u;
    if (act == 1) return 0.5f * g * (1.0f + tanhf(0.79788456080286535587989211986876f * g * (1.0f + 0.044715f * g * g))) * u;
    const float x = fminf(g, 7.0f), y = fminf(fmaxf(u, -7.0f), 7.0f);
    return x / (1.0f + expf(-1.702f * x)) * (y + 1.0f);
}
