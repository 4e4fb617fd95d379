"""Continuous batching over one paged KV cache (hybrid.kv.paged) with a radix prefix cache (hybrid.kv.radix), for a
model whose layers all run on the CPU: the BatchScheduler's steps (decode first, then prompt chunks in the -b
budget, one ragged Engine.eval_batch), with the -c cells one pool of blocks instead of -np contiguous slots.

- **Prefix cache**: a request starts from the longest whole-block prefix of its prompt that the tree holds (blocks
  shared by reference count, not copied), then copies the rows of what a running sequence holds past it (a shared
  prompt's end, inside a block); a sequence's prompt blocks enter the tree as soon as its prefill ends (so
  requests sharing a system prompt that arrive while it is evaluated wait for it, then share it), the rest of its
  blocks when it ends. The tree's unlocked leaves are evicted, least recently used first, when blocks run short.
- **Preemption**: when a step's blocks cannot be found even after eviction, the newest running sequence gives its
  blocks back and waits; it resumes (oldest first) when the pool has room, recomputing its prompt and the tokens it
  already produced (a prefix-cache hit spares what the tree still holds) and then samples on as if never stopped.

Each sequence is limited to n_ctx_slot positions (-c / -np, as the slots). No HTTP here (batch_worker.py)."""

from __future__ import annotations

from hybrid.engine.engine import GRAPH_MAX_TOKENS
from hybrid.generate.loop import check_fits
from hybrid.generate.sampling import Sampler
from hybrid.kv.blocks import OutOfBlocks
from hybrid.kv.paged import DEFAULT_BLOCK_SIZE, PagedKV
from hybrid.kv.radix import RadixCache
from hybrid.server.prompt_cache import common_prefix
from hybrid.server.scheduler import Event, Request, Seq, plan_step, prefix_in_flight, run_step


class PagedScheduler:
    slots = ()  # no per-slot prompt caches: the radix tree is the prompt cache

    def __init__(self, engine, n_slots: int, n_batch: int, n_ctx_slot: int, n_ctx_total: int,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.engine, self.n_slots, self.n_batch, self.n_ctx_slot = engine, n_slots, n_batch, n_ctx_slot
        n_blocks = max(n_ctx_total // block_size, -(-n_ctx_slot // block_size))  # one whole sequence at least
        p = engine.params
        self.kv = PagedKV(engine.config, engine.backends, n_blocks, block_size, p.type_k, p.type_v)
        self.radix = RadixCache(self.kv.pool)
        self.running: list[Seq] = []  # admission order
        self.preempted: list[Seq] = []  # oldest first
        self._nodes: dict[int, object] = {}  # id(seq) -> the radix node it locks
        self.reused_tokens = 0  # prompt tokens not evaluated: found in the prefix cache or copied (/metrics)
        self.copied_tokens = 0  # of those, rows copied from a running sequence (a shared prefix's partial block)
        self.evaluated_tokens = 0  # prompt tokens evaluated (recomputed ones included)
        self.eval_seconds = 0.0  # wall time inside Engine.eval_batch
        self.decode_steps = 0  # steps of sampled tokens alone (no prompt rows), and their time in eval_batch
        self.decode_seconds = 0.0
        self.preemptions = 0

    def warm_up(self) -> int:
        """Capture the decode graphs of 1..n_slots sequences before serving: three steps of each batch size on
        throwaway sequences of the pool (the first runs eagerly, the second is captured, the third replays), their
        blocks then given back. A batch size's first two steps otherwise cost 20-30 ms each (H200, an 8B model,
        against ~5 ms replayed) in the middle of the first loads, whenever a wave ends with that many sequences
        still running. Batch sizes past GRAPH_MAX_TOKENS run eagerly anyway, and each sequence takes a block of
        the pool. Returns the largest batch size warmed (0 where no backend replays graphs: the CPU)."""
        if not self.engine.replays_graphs:
            return 0
        bos = self.engine.tokenizer.bos_id if self.engine.tokenizer.bos_id is not None else 0
        n = min(self.n_slots, GRAPH_MAX_TOKENS, self.kv.pool.n_free)
        for b in range(1, n + 1):
            caches = [self.kv.sequence(self.n_ctx_slot) for _ in range(b)]
            try:
                for _ in range(3):
                    self.engine.eval_batch([([bos], c) for c in caches], ids=[True] * b)
            finally:
                for c in caches:
                    c.release()
        return n

    @property
    def free_slots(self) -> int:
        return self.n_slots - len(self.running) - len(self.preempted)

    @property
    def busy_cells(self) -> int:
        return sum(s.cells for s in self.running)

    def admit(self, req: Request) -> Seq:
        """A new sequence (no block taken until its first step); ContextTooLarge when the prompt cannot fit."""
        check_fits(len(req.prompt), self.n_ctx_slot)
        seq = Seq(req, None, 0, 0, Sampler(req.sampling), list(req.prompt), self.kv.sequence(self.n_ctx_slot))
        self._attach(seq)
        seq.n_cached = seq.n_done
        self.reused_tokens += seq.n_done
        self.running.append(seq)
        return seq

    def waits_for_prefix(self, prompt: list[int]) -> bool:
        """Whether a request had better wait: a running sequence is still evaluating MIN_SHARED_WAIT or more tokens
        it shares with `prompt` beyond what the tree holds; they enter the tree when its prefill ends."""
        return prefix_in_flight(prompt, self.radix.peek(prompt[: len(prompt) - 1]),
                                [s for s in self.running if s.req.cache_prompt])

    def release(self, seq: Seq) -> None:
        """The sequence ends (finished or cancelled): its whole blocks join the tree, its references go."""
        if seq in self.preempted:
            self.preempted.remove(seq)
        else:
            self.running.remove(seq)
            self._publish(seq)
        self._detach(seq)

    def step(self, beside=None) -> list[Event]:
        """One batch: resume what preemption stopped, where the pool has room; find every sequence's blocks for its
        tokens of this step (evicting, then preempting the newest); run them -> an Event for each that sampled a
        token or finished (those released). beside: host work run once the step's computation is launched
        (Engine.eval_batch), if it runs one."""
        self._resume()
        if not self.running:
            return []
        take = plan_step([s.remaining for s in self.running], self.n_batch)
        work = list(zip(self.running, take))
        for s, n in work:
            if s in self.running and n:
                self._reserve(s, s.cells + n)
        work = [(s, n) for s, n in work if s in self.running]
        prefilling = {id(s) for s, _ in work if s.remaining}
        events = run_step(self.engine, work, self, beside)
        for s, _ in work:
            if id(s) in prefilling and not s.remaining:
                self._publish(s)  # its prompt's whole blocks, for the requests that share them
        for ev in events:
            if ev.finish is not None:
                self.release(ev.seq)
        return events

    # -- blocks --------------------------------------------------------------------------------------------------
    def _attach(self, seq: Seq) -> None:
        """Start seq's empty cache from the tree's longest whole-block prefix of its source (all but the last token:
        that one is evaluated for its logits), locking the node that ends it."""
        if not seq.req.cache_prompt:
            return
        want = seq.source[: len(seq.source) - 1]
        n, blocks, node = self.radix.match(want)
        if n:
            seq.cache.adopt(blocks)
            self.radix.lock(node)
            self._nodes[id(seq)] = node
        seq.n_done = n
        # the rest of the shared prefix (a part of a block, such as the end of a system prompt) from a running
        # sequence that holds it: its rows copied
        donor, m = max(((s, min(common_prefix(want, s.history[: s.cells]), len(want))) for s in self.running),
                       key=lambda d: d[1], default=(None, 0))
        if m > n:
            try:
                seq.cache.reserve(m)
            except OutOfBlocks:
                return
            self.kv.copy_rows(donor.cache, seq.cache, n, m)
            seq.cache.n_past = seq.n_done = m
            self.copied_tokens += m - n

    def _detach(self, seq: Seq) -> None:
        node = self._nodes.pop(id(seq), None)
        if node is not None:
            self.radix.unlock(node)
        seq.cache.release()

    def _publish(self, seq: Seq) -> None:
        if seq.req.cache_prompt and seq.cells:
            self.radix.insert(seq.history[: seq.cells], seq.cache.blocks)

    def _reserve(self, seq: Seq, n_tokens: int) -> None:
        """Blocks for seq's first n_tokens: from the free pool, else from the tree's unlocked leaves, else from the
        newest running sequence (seq itself when it is the newest: it then waits)."""
        while True:
            try:
                seq.cache.reserve(n_tokens)
                return
            except OutOfBlocks:
                need = self.kv.pool.blocks_for(n_tokens) - len(seq.cache.blocks) - self.kv.pool.n_free
                if self.radix.evict(need) >= need:
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return

    def _preempt(self, seq: Seq) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self._detach(seq)
        seq.todo = list(seq.history)  # recomputed up to its sampled, not yet evaluated, token; then sampling goes on
        seq.next_token = None
        seq.n_done = 0
        self.preempted.append(seq)

    def _resume(self) -> None:
        """Preempted sequences back in line, oldest first, while the pool (free blocks and what the tree may give
        up) holds each one's whole recomputation; none while another waits ahead of it."""
        while self.preempted:
            seq = self.preempted[0]
            need = self.kv.pool.blocks_for(len(seq.source)) - self.radix.peek(seq.source) // self.kv.block_size
            if need > self.kv.pool.n_free + self.radix.evictable():
                return
            self.preempted.pop(0)
            self._attach(seq)
            self.running.append(seq)
