// The file's layout of expert rows the CPU repacked into 8-row groups (hybrid/backends/repack.py) whose layout only
// moves bytes (Q4_0_X8, MXFP4_X8): uploaded as they are, put back in place here before the dequantization.
// src, dst (n_rows, row_bytes), n_rows a multiple of 8, ts the block's bytes, nb blocks a row; perm (8 ts,): byte j
// of row r's block sits at perm[r * ts + j] within its group's repacked block of 8 ts bytes, at
// (group * nb + block) * 8 ts. One thread a destination byte, grid-strided.
extern "C" __global__ void unrepack_x8(const u8* __restrict__ src, const i32* __restrict__ perm, u8* __restrict__ dst,
                                       long long n_bytes, int row_bytes, int ts) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int nb = row_bytes / ts;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_bytes; i += stride) {
        const long long row = i / row_bytes;
        const int q = (int)(i - row * row_bytes);
        const int b = q / ts, j = q - b * ts;
        const long long group = row >> 3;
        const int r = (int)(row & 7);
        dst[i] = src[(group * nb + b) * (8LL * ts) + perm[r * ts + j]];
    }
}
