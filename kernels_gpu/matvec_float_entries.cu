// matvec_float_entries.cu: the float matvec's kernels (matvec_float.cu's body, for 1-8 tokens) and the float
// dequantizers. Apart from the body, so that moe.cu's fused router builds on the body without these.

#define MVF_ENTRY(name, KIND, NT)                                                                             \
    extern "C" __global__ void __launch_bounds__(256) matvec_##name##_##NT(                                  \
        const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n_out, int n_in,    \
        int ntok, int wpr, int vec) {                                                                         \
        if (vec) matvec_float_body<KIND, NT, true>(w, x, y, n_out, n_in, ntok, wpr);                          \
        else matvec_float_body<KIND, NT, false>(w, x, y, n_out, n_in, ntok, wpr);                             \
    }

#define MVF_ENTRIES(name, KIND)                                                                               \
    MVF_ENTRY(name, KIND, 1)                                                                                  \
    MVF_ENTRY(name, KIND, 2)                                                                                  \
    MVF_ENTRY(name, KIND, 4)                                                                                  \
    MVF_ENTRY(name, KIND, 8)                                                                                  \
    extern "C" __global__ void dequant_f32_##name(const u8* __restrict__ w, const i32* __restrict__ rows,    \
                                                  float* out, int n_rows, int n_in) {                         \
        const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                                 \
        if (i >= (long long)n_rows * n_in) return;                                                            \
        const int r = (int)(i / n_in), c = (int)(i % n_in);                                                   \
        const long long src = rows ? (long long)rows[r] : (long long)r;                                       \
        out[i] = fval<KIND>(w + (size_t)src * n_in * (KIND == 0 ? 4 : 2), c);                                 \
    }

MVF_ENTRIES(f32, 0)
MVF_ENTRIES(f16, 1)
MVF_ENTRIES(bf16, 2)
