// The GPU expert cache's lookup (hybrid/backends/moe_cache/runtime.py): one thread a routed (token, expert) pair.
// table (n_expert,) int32: the layer's row of lookup[layer, expert] -> slot or -1. For pair i: found[i] = the slot or
// -1 (copied to the host: the CPU runs the misses), slots[i] = the slot, or null_slot (an all-zero expert: its
// product is exactly 0) for a miss, and wts_hit[i] = the routing weight, 0 for a miss.
extern "C" __global__ void moe_cache_lookup(const i32* __restrict__ table, const i32* __restrict__ ids,
                                            const float* __restrict__ wts, i32* __restrict__ found,
                                            i32* __restrict__ slots, float* __restrict__ wts_hit, int n,
                                            int null_slot) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int s = table[ids[i]];
    found[i] = s;
    slots[i] = s < 0 ? null_slot : s;
    wts_hit[i] = s < 0 ? 0.0f : wts[i];
}

// The two partial sums of a cached layer's experts: out[i] = hits[i] + cpu[i] when the lookup missed some expert (one
// of found[0 .. n_found) is negative: the host computed the misses' sum into cpu), else hits[i] alone (the host was not
// waited for, and cpu holds whatever it held before).
extern "C" __global__ void moe_cache_add_misses(const float* __restrict__ hits, const float* __restrict__ cpu,
                                                const i32* __restrict__ found, int n_found, float* __restrict__ out,
                                                int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    bool miss = false;
    for (int j = 0; j < n_found; ++j) miss |= found[j] < 0;
    out[i] = miss ? hits[i] + cpu[i] : hits[i];
}
