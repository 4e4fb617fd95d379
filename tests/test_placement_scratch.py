"""placement.scratch_bytes against its reference: the GPU backend's allocations of one prefill micro-batch replayed
through a model of CuPy's memory pool; and the estimate by hand for a small config."""

from __future__ import annotations

import pytest

from hybrid.plan.placement import GEMM_CHUNK_ELEMENTS, GEMM_MIN_TOKENS, GEMM_STACK_ELEMENTS, POOL_UNIT, plan, scratch_bytes
from hybrid.system.sizes import GiB, MiB
from test_placement import LLAMA_8B, QWEN_32B, make_config, model

SMALL = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=1000)


class OutOfMemory(Exception):
    pass


class _Chunk:
    def __init__(self, block: int, offset: int, size: int):
        self.block, self.offset, self.size, self.prev, self.next, self.free = block, offset, size, None, None, False


class PoolModel:
    """CuPy's SingleDeviceMemoryPool: sizes rounded to 512, the smallest free chunk that fits (split, the rest
    stays free), neighbours in one cudaMalloc block merged when freed; past the limit, the wholly free blocks are
    given back first (free_all_blocks, CuPy >= 12.2) and only then OutOfMemory."""

    def __init__(self, limit: int):
        self.limit, self.total, self.live, self.live_peak, self.blocks = limit, 0, 0, 0, 0
        self.free_chunks: set[_Chunk] = set()

    def _release_whole_blocks(self) -> None:
        for c in [c for c in self.free_chunks if c.prev is None and c.next is None]:
            self.free_chunks.discard(c)
            self.total -= c.size

    def malloc(self, n: int) -> _Chunk:
        n = -(-n // POOL_UNIT) * POOL_UNIT
        self.live += n
        self.live_peak = max(self.live_peak, self.live)
        fit = [c for c in self.free_chunks if c.size >= n]
        if fit:
            c = min(fit, key=lambda c: (c.size, c.block, c.offset))
            self.free_chunks.discard(c)
            c.free = False
            if c.size > n:
                rest = _Chunk(c.block, c.offset + n, c.size - n)
                rest.prev, rest.next, rest.free = c, c.next, True
                if c.next is not None:
                    c.next.prev = rest
                c.next, c.size = rest, n
                self.free_chunks.add(rest)
            return c
        if self.total + n > self.limit:
            self._release_whole_blocks()
            if self.total + n > self.limit:
                raise OutOfMemory
        self.blocks += 1
        self.total += n
        return _Chunk(self.blocks, 0, n)

    def free(self, c: _Chunk) -> None:
        self.live -= c.size
        for other in (c.next, c.prev):
            if other is not None and other.free:
                self.free_chunks.discard(other)
                first, second = (c, other) if other is c.next else (other, c)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                c = first
        c.free = True
        self.free_chunks.add(c)


def _chunks(pool: PoolModel, n_in: int, n_out: int) -> None:
    """kernels_gpu.matmul._gemm's fp16 chunks of a weight, each made before the previous one is dropped."""
    rows = max(128, GEMM_CHUNK_ELEMENTS // n_in // 128 * 128)
    chunk = None
    for r0 in range(0, n_out, rows):
        new = pool.malloc(2 * (min(n_out, r0 + rows) - r0) * n_in)
        if chunk is not None:
            pool.free(chunk)
        chunk = new
    pool.free(chunk)


def _matmul(pool: PoolModel, t: int, n_in: int, n_out: int):
    """kernels_gpu.matmul of a quantized weight: the output, then (prefill) x as fp16 and the weight's fp16 chunks;
    x16 and the last chunk go when _gemm returns."""
    y = pool.malloc(4 * t * n_out)
    if t < GEMM_MIN_TOKENS:
        return y
    x16 = pool.malloc(2 * t * n_in)
    _chunks(pool, n_in, n_out)
    pool.free(x16)
    return y


def _matmuls(pool: PoolModel, t: int, n_in: int, n_outs: tuple[int, ...]) -> list:
    """kernels_gpu.matmul.matmul_many of quantized weights (GpuBackend.matmuls). Prefill makes x16 once; stacked
    (n_outs x n_in at most GEMM_STACK_ELEMENTS): the (t, sum) product and one reused scratch chunk, which goes
    with x16 before the per-weight copies are made, and the product after them; else per weight the output and
    its chunks, x16 last."""
    if t < GEMM_MIN_TOKENS:
        return [pool.malloc(4 * t * n) for n in n_outs]
    x16 = pool.malloc(2 * t * n_in)
    total = sum(n_outs)
    if len(n_outs) >= 2 and total * n_in <= GEMM_STACK_ELEMENTS:
        product = pool.malloc(4 * t * total)
        scratch = pool.malloc(2 * min(total, max(128, GEMM_CHUNK_ELEMENTS // n_in // 128 * 128)) * n_in)
        pool.free(scratch)
        pool.free(x16)
        outs = [pool.malloc(4 * t * n) for n in n_outs]
        pool.free(product)
        return outs
    outs = []
    for n in n_outs:
        outs.append(pool.malloc(4 * t * n))
        _chunks(pool, n_in, n)
    pool.free(x16)
    return outs


def _layer(pool: PoolModel, cfg, t: int, x, bias: bool):
    """hybrid/model/arch/blocks.layer_forward on the GPU backend: which buffers live when (the caller keeps x)."""
    hd = cfg.n_embd_head_k
    nq, nk = cfg.n_head * hd, cfg.n_head_kv * hd
    h = pool.malloc(4 * t * cfg.n_embd)  # attn_norm
    q, k, v = _matmuls(pool, t, cfg.n_embd, (nq, nk, nk))
    if bias:  # (t + bias for t in (q, k, v)): the three sums are made before q, k, v are dropped
        sums = [pool.malloc(4 * t * n) for n in (nq, nk, nk)]
        for old in (q, k, v):
            pool.free(old)
        q, k, v = sums
    o = pool.malloc(4 * t * nq)  # attention output (no split partials at these sizes)
    a = _matmul(pool, t, nq, cfg.n_embd)  # attn_output
    for buf in (q, k, v, o):
        pool.free(buf)
    x1 = pool.malloc(4 * t * cfg.n_embd)  # x + a
    h2 = pool.malloc(4 * t * cfg.n_embd)  # ffn_norm
    pool.free(h)
    g, u = _matmuls(pool, t, cfg.n_embd, (cfg.n_ff, cfg.n_ff))
    act = pool.malloc(4 * t * cfg.n_ff)  # glu
    d = _matmul(pool, t, cfg.n_ff, cfg.n_embd)
    for buf in (g, u, act):
        pool.free(buf)
    out = pool.malloc(4 * t * cfg.n_embd)  # x1 + d
    for buf in (x1, a, h2, d):
        pool.free(buf)
    return out


def replay(cfg, t: int, n_layers: int, limit: int, bias: bool = False) -> PoolModel:
    """Engine.run_gpu_layers(t tokens) as `hybrid probe` runs it: n_layers GPU layers, then the output layer on
    every row. Raises OutOfMemory when the pool cannot stay under `limit` (the scratch's share of the budget)."""
    pool = PoolModel(limit)
    x = pool.malloc(4 * t * cfg.n_embd)  # from_host
    pool.malloc(4 * t)  # the positions, kept by the backend
    for _ in range(n_layers):
        nxt = _layer(pool, cfg, t, x, bias)
        pool.free(x)
        x = nxt
    normed = pool.malloc(4 * t * cfg.n_embd)
    pool.free(_matmul(pool, t, cfg.n_embd, cfg.n_vocab))
    pool.free(normed)
    return pool


def least_limit(cfg, t: int, bias: bool = False) -> int:
    """The smallest pool limit (to 64 KiB) under which the replay runs: the scratch the device really needs."""
    lo, hi = 0, 8 * GiB
    while hi - lo > 64 << 10:
        mid = (lo + hi) // 2
        try:
            replay(cfg, t, 3, mid, bias)
            hi = mid
        except OutOfMemory:
            lo = mid
    return hi


@pytest.mark.parametrize("shape, bias", [(LLAMA_8B, False), (QWEN_32B, True), (SMALL, False)],
                         ids=["8B", "32B-qkv-bias", "small"])
@pytest.mark.parametrize("t", [512, 128, 16])
def test_estimate_brackets_the_pool_model(shape, bias, t):
    cfg = make_config(**shape)
    s = scratch_bytes(cfg, 4096, t, True, 5, 4096, bias)
    assert s.peak == replay(cfg, t, 3, 1 << 62, bias).live_peak  # the live peak, exactly
    need = least_limit(cfg, t, bias)
    assert s.peak <= need <= s.total  # a lower bound refuses nothing that runs; `auto` plans for all of it


def test_estimate_by_hand():
    """SMALL at T = 32 tokens: hidden A = 32 x 256 x 4 = 32768 B; every buffer a multiple of 512 already."""
    cfg = make_config(**SMALL)
    s = scratch_bytes(cfg, 4096, 32, True, 5)
    a, pos = 32768, 512  # 32 positions x 4 B, rounded up to 512
    # output layer: x, normed x, logits 32 x 1000 x 4, fp16 x 32 x 256 x 2, one fp16 chunk 1000 x 256 x 2
    assert s.logits == pos + 2 * a + (128000 + 16384 + 512000) == 722432
    # gate/up, stacked (2 x 512 x 256 <= GEMM_STACK_ELEMENTS): x, x + attn, attn, normed (4 A), fp16 x 32 x 256 x 2,
    # the product 32 x 1024 x 4, the scratch 1024 x 256 x 2 (FFN down: 4 A + 3 x 65536 + A + 32768 + 262144 less)
    assert s.activations == pos + 4 * a + (16384 + 131072 + 524288) == 803328
    assert s.peak == 803328 and s.total == 803328 + s.slack
    assert s.slack == 1024 * 256 * 2  # the largest block of a layer: the stacked gate/up scratch
    assert scratch_bytes(cfg, 4096, 32, True, 1).activations == 0  # the output layer alone
    assert scratch_bytes(cfg, 4096, 32, True, 0).total == 0
    assert scratch_bytes(cfg, 20, 32, True, 5) == scratch_bytes(cfg, 20, 20, True, 5)  # a ubatch never exceeds n_ctx
    # without flash attention the KQ scores (32 x 4 heads x n_kv) sit in the attention set: 32 x 4 x 16384 x 4
    no_fa = scratch_bytes(cfg, 16384, 32, False, 5, 16384)
    assert no_fa.activations == pos + 2 * a + (a + 2 * 16384) + a + 32 * 4 * 16384 * 4
    # one token (decode): no GEMM staging
    assert scratch_bytes(cfg, 4096, 1, True, 5).logits == 512 + 2 * 1024 + 4000 + 96


def test_llama_8b_by_hand():
    """The output layer of Llama-3-8B at T = 512: 128256 rows in chunks of 2^26 / 4096 = 16384 rows (128 MiB of
    fp16), two alive at once; it outweighs the FFN (250 MiB)."""
    cfg, _ = model(LLAMA_8B)
    s = scratch_bytes(cfg, 4096, 512, True, 33)
    assert s.logits == 2048 + 2 * 8 * MiB + 512 * 128256 * 4 + 4 * MiB + 2 * 128 * MiB
    assert s.activations == 2048 + 4 * 8 * MiB + 3 * 28 * MiB + 8 * MiB + 14 * MiB + 112 * MiB
    assert s.slack == 112 * MiB  # ffn_gate (14336 x 4096) in one fp16 chunk


def test_explicit_ngl_is_refused_only_when_the_live_buffers_do_not_fit():
    """`auto` plans for peak + slack; an explicit -ngl up to what the peak allows is the device's to judge (the
    probe's measured ceiling must run), beyond it a PlacementError with the least it needs."""
    from hybrid.errors import PlacementError

    cfg, ts = model(LLAMA_8B)
    full = plan(cfg, ts, 1 << 62, 20, 4096)
    s = full.scratch
    budget = full.gpu_total_bytes - s.slack // 2  # the live buffers fit, the slack does not
    p = plan(cfg, ts, budget, 20, 4096)
    assert p.max_fit_ngl == 19 == plan(cfg, ts, budget, "auto", 4096).n_gpu_layers
    assert p.headroom_bytes < 0 and any("hybrid probe" in r for r in p.reasons)
    with pytest.raises(PlacementError, match="20 layers need at least"):
        plan(cfg, ts, full.gpu_total_bytes - s.slack - 1, 20, 4096)


def test_mirrored_gemm_constants_match_the_gpu_kernels():
    # hybrid.placement may not import kernels_gpu at module level (it runs without CuPy), so it mirrors two of its
    # constants; the estimate is only right while they agree
    import kernels_gpu.matmul as gpu_matmul

    assert GEMM_MIN_TOKENS == gpu_matmul.GEMM_MIN_TOKENS
    assert GEMM_CHUNK_ELEMENTS == gpu_matmul.GEMM_CHUNK_ELEMENTS
    assert GEMM_STACK_ELEMENTS == gpu_matmul.GEMM_STACK_ELEMENTS
