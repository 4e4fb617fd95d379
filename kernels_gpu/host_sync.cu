// A decode step's host breaks inside one CUDA graph (graph.py): the GPU tells the host where it stands and waits for
// the host's answer through flags in page-locked host memory the device reads and writes in place (one address for
// both under unified addressing). One thread each.

// *flag = value, after every write this step made before it (the copies to pinned memory run before, in stream order)
extern "C" __global__ void host_signal(volatile int* flag, int value) {
    __threadfence_system();
    *flag = value;
    __threadfence_system();
}

// wait until *flag >= value (the host's call is done and its results are in pinned memory); after max_cycles of the
// GPU's clock, give up and set *timed_out (the host reports the step as failed: its results would be stale)
__device__ __forceinline__ void wait_for(const volatile int* flag, int value, volatile int* timed_out,
                                         long long max_cycles) {
    const long long t0 = clock64();
    while (*flag < value) {
        if (clock64() - t0 > max_cycles) {
            *timed_out = 1;
            __threadfence_system();
            return;
        }
        __nanosleep(256);
    }
    __threadfence_system();
}

extern "C" __global__ void host_wait(const volatile int* flag, int value, volatile int* timed_out,
                                     long long max_cycles) {
    wait_for(flag, value, timed_out, max_cycles);
}

// host_wait, only when one of vals[0 .. n) is negative (the host's answer is then needed: an expert the GPU's cache
// missed, which the host computes); otherwise the GPU goes on at once and the host's call for this break runs while
// it does (its results unread by the step)
extern "C" __global__ void host_wait_if_negative(const volatile int* flag, int value, volatile int* timed_out,
                                                 long long max_cycles, const int* __restrict__ vals, int n) {
    bool need = false;
    for (int i = 0; i < n; ++i) need |= vals[i] < 0;
    if (need) wait_for(flag, value, timed_out, max_cycles);
}
