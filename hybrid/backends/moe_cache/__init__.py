"""The GPU cache of hot experts (issue 16): routing traces (`trace`: what `hybrid trace-experts` records and saves,
`stats`: their per-layer summary), the cache policies (`policy`: per-layer slot pools with LRU, LFU and LFRU eviction
under an admission cap, a static top list; `belady`: the offline optimum), replayed over a trace by `simulate`
(scripts/sim_expert_cache.py), all pure numpy; and the runtime cache of --moe-cache (`book`: its host bookkeeping,
no GPU; `runtime`: slot pools and the lookup table on the device, hits on the GPU beside misses on the CPU). See
docs/MOE_CACHE.md."""
