"""The GPU cache of hot experts (issue 16), its first parts: routing traces (`trace`: what `hybrid trace-experts`
records and saves, `stats`: their per-layer summary) and the cache policies (`policy`: per-layer slot pools with
LRU, LFU and LFRU eviction under an admission cap, a static top list; `belady`: the offline optimum), replayed over
a trace by `simulate` (scripts/sim_expert_cache.py). Pure numpy: no GPU needed. See docs/MOE_CACHE.md."""
