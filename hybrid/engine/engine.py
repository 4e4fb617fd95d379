"""Engine: a loaded model (config, weights, tokenizer, a backend per layer) that evaluates tokens.

Prefill runs the prompt in micro-batches of -ub tokens, layer by layer on each layer's device; decode runs one
token at a time. Per-conversation state (the KV cache) is passed in, never kept here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from gguf_io import GGUFFile, ModelConfig, open_gguf

from hybrid.backends.cpu import CpuBackend
from hybrid.backends.cpu_kernels import cpu_kernel_keys
from hybrid.backends.host_experts import check_host_experts
from hybrid.backends.op_offload import make_op_offload
from hybrid.backends.repack import repack_host_experts, repack_weights
from hybrid.engine.params import EngineParams
from hybrid.errors import ContextTooLarge, HybridError
from hybrid.engine.lazy_rows import LazyRows
from hybrid.kv.batch import KVBatch
from hybrid.kv.cache import KVCache
from hybrid.kv.paged import single_sequence, supports_paging
from hybrid.kv.types import check_kv_types
from hybrid.model import forward
from hybrid.model.arch import adopt_layers, arch_spec
from hybrid.model.arch.spec import ArchSpec
from hybrid.model.weights import ModelWeights, load_weights
from hybrid.plan.budget import plan_for
from hybrid.plan.overrides import unused_warnings
from hybrid.plan.placement import PlacementPlan
from hybrid.system.memlock import prepare_cpu_weights
from hybrid.system.numa import check_mode as check_numa_mode
from hybrid.system.numa import memory_policy
from hybrid.system.sizes import format_size
from hybrid.text.tokenizer import Tokenizer

Progress = Callable[[str], None] | None


# A speculative check of at most this many tokens runs through the decode CUDA graphs (one graph per batch size; the
# GPU's matvec kernels take up to 8 tokens a launch, kernels_gpu.matmul.MATVEC_MAX_TOKENS); a bigger one, eagerly.
GRAPH_MAX_TOKENS = 8
# A server step that carries prompt chunks beside decoding sequences (a mixed batch of paged sequences of one pool) runs
# through decode_step, as one CUDA graph per composition (each sequence's rows), up to this many rows, where one GPU
# holds every layer and the output of a dense model and every weight's type has a kernel for that many rows that a
# capture takes (GpuBackend.captures_products: the tensor-core products of Q4_K and Q6_K, not cuBLAS's GEMM, which
# CuPy refuses inside a stream capture). scripts/gpu_mixed_step.py measures it; tests/test_gpu_paged.py checks it.
MIXED_GRAPH_MAX_ROWS = 64
# A composition takes the graphs from its second step on: its first runs eagerly and leaves no graph entry, so the
# one-off compositions of a server (a prompt's last, shorter chunk) do not push decode graphs out of the runner's
# LRU (GraphRunner.max_graphs); a chunked prompt's repeated composition is captured at its third step. Engine
# remembers the last MIXED_SEEN compositions.
MIXED_SEEN = 256


@dataclass
class Engine:
    gguf: GGUFFile
    config: ModelConfig
    spec: ArchSpec
    weights: ModelWeights
    tokenizer: Tokenizer
    params: EngineParams
    backends: list = field(default_factory=list)  # one per repeating layer
    output_backend: object = None
    placement: PlacementPlan | None = None  # None: everything on the CPU
    op_offload: object = None  # backends.op_offload.OpOffload when big batches of CPU layers run on the GPU
    checks_prepared: set = field(default_factory=set)  # (cache size, draft lengths) whose check graphs are captured
    mixed_seen: dict = field(default_factory=dict)  # the last MIXED_SEEN compositions of mixed batches (_mixed_graph)

    @classmethod
    def load(cls, path: str | Path, params: EngineParams = EngineParams(), progress: Progress = None,
             on_placed: Callable[["Engine"], None] | None = None) -> "Engine":
        """Open the GGUF, place -ngl layers on the GPU (KV cache first, then the output layer, then layers from the
        last one backwards), set up op offload, repack the CPU layers, then --numa/--mlock their pages.
        on_placed(engine) runs once every layer has its backend, before the repack (a first run compiles the CPU's
        kernels there, the repack's among them: `cpu_kernels`)."""
        engine = cls.open(path, params, progress)
        p = engine.params
        try:
            if p.n_gpu_layers != 0:
                from hybrid.backends.gpu import GpuBackend  # noqa: PLC0415 - CuPy is optional

                gpu = GpuBackend()
                budget = p.vram_budget if p.vram_budget is not None else gpu.free_bytes()
                gpu.limit_memory(budget)
                engine.place(plan_for(engine.config, engine.gguf.tensors, budget, p.n_gpu_layers, p.plan_inputs()),
                             gpu, gpu.upload)
                gpu.host_experts.min_batch = None if p.op_offload else 0  # --no-op-offload: experts on the CPU
                moe_ram = [engine.weights.layers[lp.index] for lp in engine.placement.layers if lp.experts_on_cpu]
                cache = engine.placement.moe_cache  # --moe-cache: its uploads read the locked pages too
                if moe_ram and p.repack and not cache.on:  # (the cache's GPU kernels read the file's layout)
                    engine._repack_host_experts(moe_ram, progress)
                if moe_ram and (p.op_offload or cache.on):  # big batches upload their experts by DMA from them
                    why = gpu.host_experts.register(moe_ram)
                    if why and progress:
                        progress(f"warning: experts in RAM could not be page-locked ({why}); big batches stage "
                                 f"their uploads through pinned buffers")
                if cache.note:
                    from hybrid.backends.moe_cache.runtime import attach_expert_cache  # noqa: PLC0415

                    line = attach_expert_cache(gpu, cache, {il: engine.weights.layers[il] for il in cache.layers},
                                               engine.spec, engine.config, p.moe_cache_policy,
                                               None if p.moe_cache_inserts < 0 else p.moe_cache_inserts)
                    if progress:
                        progress(line)
                if progress:
                    pl = engine.placement
                    progress(f"offloaded {pl.n_gpu_layers}/{engine.config.n_layer + 1} layers to the GPU "
                             f"({format_size(pl.gpu_total_bytes, 2)} of a {format_size(budget, 2)} budget)")
                    if pl.n_cpu_moe:
                        moe = [lp for lp in pl.layers if lp.experts_on_cpu]
                        progress(f"routed experts of {len(moe)} GPU layers stay in RAM, run by the CPU "
                                 f"({format_size(sum(lp.expert_bytes for lp in moe), 2)})")
            if p.op_offload:
                engine.op_offload = make_op_offload(engine.backends, engine.output_backend, engine.config,
                                                    engine.gguf.tensors, p.n_ctx, p.n_ubatch, p.type_k, p.type_v,
                                                    p.flash_attn, p.vram_budget, progress)
                engine._lock_offloaded_experts(progress)
            if on_placed is not None:
                on_placed(engine)
            if engine.repacks:
                engine._repack(progress)
        except BaseException:
            engine.gguf.close()
            raise
        notes, _ = prepare_cpu_weights(engine.weights.host_arrays(), p.numa, p.use_mlock)  # after the GPU's share
        for msg in notes:
            if progress:
                progress(msg)
        return engine

    @classmethod
    def open(cls, path: str | Path, params: EngineParams = EngineParams(), progress: Progress = None) -> "Engine":
        """Open the GGUF (memory-mapped), check it holds what its architecture needs; every layer on the CPU."""
        check_kv_types(params.type_k, params.type_v)
        check_numa_mode(params.numa)
        f = open_gguf(path, use_mmap=params.use_mmap)
        try:
            config = ModelConfig.from_gguf(f)
            spec = arch_spec(config.arch)
            weights = load_weights(f, config)
            adopt_layers(spec, config, weights)
            tokenizer = Tokenizer.from_metadata(f.metadata)
        except BaseException:
            f.close()
            raise
        if progress:
            for line in unused_warnings(f.tensors, params.overrides):
                progress(line)
        n_ctx = params.n_ctx or config.n_ctx_train
        if n_ctx > config.n_ctx_train > 0 and progress:
            progress(f"warning: -c {n_ctx} is larger than the model's training context {config.n_ctx_train}")
        params = replace(params, n_ctx=n_ctx, n_ubatch=min(params.n_ubatch, params.n_batch))
        cpu = CpuBackend()
        return cls(f, config, spec, weights, tokenizer, params, [cpu] * config.n_layer, cpu)

    def place(self, placement: PlacementPlan, gpu, upload: Callable) -> None:
        """Move the plan's GPU layers (and the output layer, if the plan says so) to backend `gpu`, each weight
        through upload(Weight) -> device Weight (the quantized blocks as they are, or placeholders of their size)."""
        self.placement = placement
        for lp in placement.layers:
            if lp.experts_on_cpu:
                check_host_experts(self.spec, self.config, self.weights.layers[lp.index])
            if lp.device == "gpu":  # a GPU layer's routed experts may stay in host memory (-ot, --n-cpu-moe)
                self.weights.layers[lp.index] = {
                    k: upload(w) if placement.tensor_device(w.name) == "gpu" else w
                    for k, w in self.weights.layers[lp.index].items()}
                self.backends[lp.index] = gpu
        if placement.output.device == "gpu":
            self.weights.output = upload(self.weights.output)
            self.weights.output_norm = upload(self.weights.output_norm)
            self.output_backend = gpu

    def _repack_host_experts(self, layers: list[dict], progress: Progress) -> None:
        """The routed experts in RAM of GPU layers, where the CPU's repacked layout only moves bytes (MXFP4, Q4_0),
        into it (backends/repack.py repack_host_experts): their decode runs on the CPU's faster dots, and a big
        batch still uploads them as they are (the GPU puts the bytes back, kernels_gpu.unrepack)."""
        from hybrid.backends.host_experts import EXPERT_TENSORS  # noqa: PLC0415

        done = self._with_numa_policy(lambda: repack_host_experts(layers, EXPERT_TENSORS))
        if done.n_matrices and progress:
            progress(f"repack: the experts in RAM of {len(layers)} GPU layers ({', '.join(done.types)}) interleaved "
                     f"by 8 rows for the CPU ({format_size(done.n_bytes)})")

    def _lock_offloaded_experts(self, progress: Progress) -> None:
        """With op offload, page-lock the CPU layers' routed experts in place (as --mlock would), so that a big
        batch uploads the experts it uses by DMA from them, on a copy stream ahead of the kernels
        (HostExperts.run_uploaded), instead of staging pageable copies through pinned buffers."""
        if self.op_offload is None:
            return
        layers = [self.weights.layers[il] for il, be in enumerate(self.backends)
                  if isinstance(be, CpuBackend) and "ffn_gate_exps" in self.weights.layers[il]]
        if not layers:
            return
        why = self.op_offload.gpu.host_experts.register(layers)
        if why and progress:
            progress(f"warning: the CPU layers' experts could not be page-locked ({why}); big batches stage their "
                     f"uploads through pinned buffers")

    @property
    def repacks(self) -> bool:
        """Whether loading repacks the CPU layers (op offload streams their blocks to the GPU as they are)."""
        return self.params.repack and self.op_offload is None

    def moe_report(self) -> str:
        """What the GPU layers whose routed experts stay in RAM did so far, in one line ("" when none does): the
        layer-batches the CPU ran and its time, the batches that uploaded their experts and the bytes, the last
        one's bytes."""
        if self.placement is None or not self.placement.n_cpu_moe:
            return ""
        gpu = next(b for b in self.backends if hasattr(b, "host_experts"))
        s = gpu.host_experts.stats
        return (f"experts in RAM: the CPU ran {s.cpu_batches} layer-batches ({s.cpu_tokens} tokens, "
                f"{s.cpu_seconds:.2f} s); {s.gpu_batches} uploaded their experts ({format_size(s.uploaded_bytes, 2)}, "
                f"the last {format_size(s.last_upload_bytes, 2)})")

    @contextmanager
    def observe_routing(self, observer) -> Iterator[None]:
        """Within: every MoE layer's routing of the evaluated tokens goes to observer.routed(layer, ids, weights)
        (model.arch.moe.RoutingObserver), from whichever backend runs the layer (op offload's reads its GPU's); GPU
        decode steps run eagerly meanwhile. Outside, no backend holds it (a None test per MoE layer)."""
        extra = [] if self.op_offload is None else [self.op_offload.gpu]  # -ngl 0's op offload has its own GPU
        held = {id(b): b for b in (*self.backends, self.output_backend, *extra)
                if hasattr(b, "routing_observer")}.values()
        for b in held:
            b.routing_observer = observer
        try:
            yield
        finally:
            for b in held:
                b.routing_observer = None

    def cpu_kernels(self) -> tuple[str, ...]:
        """The compiled kernels a warm-up calls on the CPU (keys of kernels_cpu.signatures), the repack's included
        when it is still to come: see hybrid/backends/cpu_kernels.py."""
        layers = [self.weights.layers[il] for il, be in enumerate(self.backends) if isinstance(be, CpuBackend)]
        on_cpu = isinstance(self.output_backend, CpuBackend)
        w = self.weights
        return cpu_kernel_keys(self.spec, layers, w.output if on_cpu else None, self.repacks,
                               output_tied=w.output is w.token_embd, embedding=w.token_embd)

    def _with_numa_policy(self, fn):
        """fn() with the pages it first writes placed as --numa says (a repack's copies)."""
        try:
            with memory_policy(self.params.numa):
                return fn()
        except OSError:  # the policy was refused (prepare_cpu_weights says so): the copies stay where they fall
            return fn()

    def _repack(self, progress: Progress) -> None:
        """The CPU layers' matrices into the 8-row interleaved layouts (backends/repack.py)."""
        cpu_layers = [il for il, be in enumerate(self.backends) if isinstance(be, CpuBackend)]
        on_cpu = isinstance(self.output_backend, CpuBackend)
        done = self._with_numa_policy(lambda: repack_weights(self.weights, cpu_layers, on_cpu))
        if done.n_matrices and progress:
            progress(f"repack: {done.n_matrices} matrices ({', '.join(done.types)}) interleaved by 8 rows for the "
                     f"CPU ({format_size(done.n_bytes)})")

    @property
    def cpu(self) -> CpuBackend:
        """A CPU backend of this engine (the embedding always runs there)."""
        return next((b for b in [*self.backends, self.output_backend] if isinstance(b, CpuBackend)), CpuBackend())

    def close(self) -> None:
        """Release the mapping and drop every device buffer this engine holds."""
        if self.op_offload is not None:
            self.op_offload.close()
        self.weights.layers = []
        self.backends, self.output_backend, self.op_offload = [], None, None
        self.gguf.close()

    def warmup(self) -> None:
        """Run a 2-token batch and a 1-token step on a scratch cache so every kernel is compiled (or loaded from
        Numba's cache) before anything is timed, as llama.cpp warms up with an empty run."""
        cache = self.new_cache(8)
        bos = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else 0
        self.eval([bos, bos], cache)
        self.eval([bos], cache)

    def new_cache(self, n_ctx: int | None = None, paged: bool | None = None) -> KVCache:
        """An empty KV cache of n_ctx positions (default -c): paged (hybrid.kv.paged, a pool of its own read through
        a block table, as the server's sequences) where params.kv_paged (or `paged`) asks for it and every layer's
        backend reads block tables; else one contiguous storage a layer (paged=False: the -np 1 server's prompt
        cache, which copies rows by position)."""
        n, p = n_ctx or self.params.n_ctx, self.params
        if (p.kv_paged if paged is None else paged) and supports_paging(self.backends):
            return single_sequence(self.config, self.backends, n, p.type_k, p.type_v)
        return KVCache.create(self.config, self.backends, n, p.type_k, p.type_v)

    def eval(self, tokens: list[int] | np.ndarray, cache: KVCache, logits_from: int | None = None,
             beside: Callable[[], None] | None = None) -> np.ndarray:
        """Append `tokens` at positions cache.n_past.. and return logits (float32).

        logits_from=None: only the last token's logits (n_vocab,); else the logits of tokens[logits_from:]
        as (n, n_vocab). beside(): host work that does not touch the engine, run once, while the step computes
        where it can (a decode step replayed on the GPU: after its launch), else before the step.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        n = tokens.shape[0]
        self._check(tokens, cache)
        # one token, or a speculative check's few with every row wanted: GPU runs replayed as CUDA graphs
        if self.replays_graphs and (n == 1 or (n <= GRAPH_MAX_TOKENS and logits_from == 0)):
            logits = self._decode(tokens, [cache], [n], beside=beside)  # (n, n_vocab)
            cache.n_past += n
            return logits[-1] if logits_from is None else logits
        if beside is not None:
            beside()
        first = n - 1 if logits_from is None else logits_from
        out = []
        ub = self.params.n_ubatch
        for s in range(0, n, ub):
            e = min(n, s + ub)
            positions = np.arange(cache.n_past + s, cache.n_past + e, dtype=np.int32)
            h, where = self._layers(tokens[s:e], positions, cache)  # h stays on the last layer's device
            lo = max(first, s)
            if lo < e:
                out.append(self._logits(h[lo - s :], where))
        cache.n_past += n
        logits = np.concatenate(out, axis=0)
        return logits[-1] if logits_from is None else logits

    def eval_batch(self, seqs: Sequence[tuple[Sequence[int], KVCache]], want: Sequence[bool] | None = None,
                   beside: Callable[[], None] | None = None,
                   ids: Sequence[bool] | None = None) -> list[np.ndarray | int | None]:
        """One step over a ragged batch: seqs[i] = (tokens, cache), its tokens appended at cache.n_past..; each
        cache at most once. Everything but attention runs once over the stacked rows (the matmuls read each weight
        once for the whole batch), attention per sequence through its own cache (hybrid.kv.batch). Returns, per
        sequence, the last token's logits (n_vocab,) float32, or None where want[i] is False. A single sequence
        takes eval's path (fused forms, CUDA graphs); a decode step of up to GRAPH_MAX_TOKENS paged sequences of
        one pool (a token each) runs through the GPU's decode graphs, one per batch size (and, where
        MIXED_GRAPH_MAX_ROWS and the weights' kernels allow it, a step of such sequences with prompt chunks among
        them, a graph per composition); other batches run op by op, eagerly. beside: as eval's (the batched
        server hands its clients the last step's tokens there). ids: where ids[i] is True, sequence i's entry is
        the id of its largest logit (an int: greedy sampling) instead of its logits; when every wanted entry is
        one, a step replayed on the GPU brings only the ids back, not n_vocab logits a row."""
        want = [True] * len(seqs) if want is None else list(want)
        if len({id(c) for _, c in seqs}) != len(seqs):
            raise HybridError("eval_batch: a KV cache appears twice in one batch")
        ids = [False] * len(seqs) if ids is None else [bool(i) for i in ids]
        only = any(ids) and all(i or not wt for i, wt in zip(ids, want))
        out = self._eval_batch(seqs, want, beside, only)
        if only:
            return out
        return [int(np.argmax(lg)) if i and lg is not None else lg for lg, i in zip(out, ids)]

    def _eval_batch(self, seqs, want: list[bool], beside, ids_only: bool) -> list:
        """eval_batch's step: each wanted entry its logits, or with ids_only its argmax id."""
        toks = [np.asarray(t, dtype=np.int64) for t, _ in seqs]
        for t, (_, cache) in zip(toks, seqs):
            self._check(t, cache)
        if len(seqs) == 1:
            t, cache = toks[0], seqs[0][1]
            if ids_only and self.replays_graphs and len(t) == 1:  # eval's decode step, only the id crossing back
                got = self._decode(t, [cache], [1], beside=beside, ids_only=True)
                cache.n_past += 1
                return [int(got[-1]) if want[0] else None]
            logits = self.eval(t, cache, beside=beside)
            return [(int(np.argmax(logits)) if ids_only else logits) if want[0] else None]
        caches = [c for _, c in seqs]
        lengths = [len(t) for t in toks]
        decode = len(seqs) <= GRAPH_MAX_TOKENS and all(n == 1 for n in lengths)
        if self.replays_graphs and (decode or self._mixed_graph(lengths)) and _one_pool(caches):
            last = None if decode else np.cumsum(lengths) - 1  # the rows whose logits are computed: each last one
            got = self._decode(np.concatenate(toks), caches, lengths, last, beside=beside, ids_only=ids_only)
            for c, n in zip(caches, lengths):
                c.n_past += n
            return [(int(got[i]) if ids_only else got[i]) if want[i] else None for i in range(len(seqs))]
        if beside is not None:
            beside()
        out: list[np.ndarray | None] = [None] * len(seqs)
        lasts: list[tuple[list[int], object, object]] = []  # (sequences, backend, their last hidden rows) a ubatch
        for piece in _ubatches([len(t) for t in toks], self.params.n_ubatch):  # [(seq, first, end)] per ubatch
            caches = [seqs[i][1] for i, _, _ in piece]
            tokens = np.concatenate([toks[i][a:b] for i, a, b in piece])
            positions = np.concatenate([np.arange(c.n_past + a, c.n_past + b, dtype=np.int32)
                                        for c, (_, a, b) in zip(caches, piece)])
            h, where = self._layers(tokens, positions, KVBatch.of(caches, [b - a for _, a, b in piece]))
            ends = np.cumsum([b - a for _, a, b in piece]) - 1  # each sequence's last row in this ubatch
            rows = [(r, i) for r, (i, _, b) in zip(ends, piece) if b == len(toks[i]) and want[i]]
            if rows:
                lasts.append(([i for _, i in rows], where,
                              where.take_rows(h, np.array([r for r, _ in rows], dtype=np.int64))))
        for idx, logits in self._lasts_logits(lasts):
            for j, i in enumerate(idx):
                out[i] = logits[j]
        for t, (_, cache) in zip(toks, seqs):
            cache.n_past += len(t)
        return [int(np.argmax(o)) if o is not None else None for o in out] if ids_only else out

    def _lasts_logits(self, lasts: list) -> list[tuple[list[int], np.ndarray]]:
        """The logits of the last hidden rows a step's micro-batches left, [(sequences, (k, n_vocab))]: where one
        backend holds them all, stacked for one pass of the output layer and one device-to-host copy after the last
        micro-batch (the host launches each micro-batch while the GPU still runs the one before); else each
        micro-batch's rows on their own."""
        if len(lasts) < 2 or len({id(where) for _, where, _ in lasts}) > 1:
            return [(idx, self._logits(h, where)) for idx, where, h in lasts]
        where = lasts[0][1]
        n = sum(len(idx) for idx, _, _ in lasts)
        stacked = where.zeros((n, lasts[0][2].shape[1]))
        r = 0
        for idx, _, h in lasts:  # 0 + 1 * h: each row exactly
            where.scatter_add(stacked, np.arange(r, r + len(idx)), h, np.ones(len(idx), dtype=np.float32))
            r += len(idx)
        return [([i for idx, _, _ in lasts for i in idx], self._logits(stacked, where))]

    def _mixed_graph(self, lengths: list[int]) -> bool:
        """Whether a batch of sequences of these lengths, some of several tokens, runs as a decode graph: at most
        MIXED_GRAPH_MAX_ROWS rows of a dense model, every layer and the output on one GPU backend that replays
        decode steps, every product of the step one that a capture takes, and a composition seen before
        (MIXED_SEEN)."""
        n = sum(lengths)
        if n > MIXED_GRAPH_MAX_ROWS or self.config.n_expert > 0 or max(lengths) == 1:  # (a decode batch of more
            return False  # than GRAPH_MAX_TOKENS stays eager: not yet run through here; op offload: excluded below)
        be = self.output_backend
        if not (hasattr(be, "decode_step") and all(b is be for b in self.backends)):
            return False
        if not (be.captures_products(self._matrix_types, n)
                and be.captures_products({self.weights.output.type_name}, len(lengths))):
            return False
        key = tuple(lengths)
        if key in self.mixed_seen:
            return True
        self.mixed_seen[key] = None  # its first step: eagerly (MIXED_SEEN)
        if len(self.mixed_seen) > MIXED_SEEN:
            del self.mixed_seen[next(iter(self.mixed_seen))]
        return False

    @cached_property
    def _matrix_types(self) -> frozenset[str]:
        """The GGML types of the repeating layers' matrices."""
        return frozenset(w.type_name for lw in self.weights.layers for w in lw.values() if len(w.shape) == 2)

    @property
    def replays_graphs(self) -> bool:
        """Whether some backend replays decode steps as CUDA graphs (a GPU's)."""
        return any(hasattr(b, "decode_step") for b in (*self.backends, self.output_backend))

    def _check(self, tokens: np.ndarray, cache: KVCache) -> None:
        """HybridError for an empty batch or a token id out of range, ContextTooLarge when it does not fit."""
        n = tokens.shape[0]
        if n == 0:
            raise HybridError("nothing to evaluate: the token list is empty")
        if cache.n_past + n > cache.n_ctx:
            raise ContextTooLarge(
                f"{cache.n_past + n} tokens do not fit the context of {cache.n_ctx} (-c); raise -c or shorten the input"
            )
        if tokens.min() < 0 or tokens.max() >= self.config.n_vocab:
            raise HybridError(f"token id out of range [0, {self.config.n_vocab})")
        cache.reserve(cache.n_past + n)  # a paged cache takes its blocks now (OutOfBlocks: nothing computed)

    def draft_lengths(self, k_max: int) -> tuple[int, ...] | None:
        """The speculative draft lengths worth trying: on a GPU those whose check (the draft and the token before
        it) is 2, 4 or 8 tokens, each one CUDA graph to capture; on the CPU any (None)."""
        if not self.replays_graphs:
            return None
        return tuple(n - 1 for n in (2, 4, GRAPH_MAX_TOKENS) if n - 1 <= k_max) or (1,)

    def prepare_checks(self, cache: KVCache, lengths) -> None:
        """Capture the decode graphs of the checks a speculative generation may run on this cache's shape (draft
        lengths `lengths`), once: two evaluations of each size past the cache's tokens (the first runs eagerly, the
        second is captured), then the cache rolled back, its cells past n_past to be overwritten. No-op on the CPU,
        or where the cache has no room."""
        if not self.replays_graphs:
            return
        key = (cache.n_ctx, tuple(sorted(set(lengths))))
        if key in self.checks_prepared:
            return
        n_past = cache.n_past
        bos = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else 0
        try:
            for k in sorted(set(lengths)):
                n = k + 1
                if n > GRAPH_MAX_TOKENS or n_past + n > cache.n_ctx:
                    continue
                for _ in range(2):
                    self.eval([bos] * n, cache, logits_from=0)
                    cache.n_past = n_past
        finally:
            cache.n_past = n_past
        self.checks_prepared.add(key)

    def eval_rows(self, tokens: list[int] | np.ndarray, cache: KVCache) -> "LazyRows":
        """As eval(tokens, cache, logits_from=0) for a speculative check (tokens fewer than -ub), with each row's
        logits computed when first read (LazyRows): the rows after a rejected draft token are never read. On the
        CPU a row of the output layer costs as much alone as in a batch (the few-token integer dots are compute-bound
        there), so a row is computed at a time; on the GPU, where a batch reads the weights once, the rest of the
        rows are computed together at the first read."""
        tokens = np.asarray(tokens, dtype=np.int64)
        n = tokens.shape[0]
        if n == 1 or n > self.params.n_ubatch or (self.replays_graphs and n <= GRAPH_MAX_TOKENS):
            return LazyRows.ready(self.eval(tokens, cache, logits_from=0))
        self._check(tokens, cache)
        positions = np.arange(cache.n_past, cache.n_past + n, dtype=np.int32)
        h, where = self._layers(tokens, positions, cache)
        cache.n_past += n
        one_by_one = self.output_backend is self.cpu and (self.op_offload is None or not self.op_offload.wants(1))
        return LazyRows(lambda a, b: self._logits(h[a:b], where), n, 1 if one_by_one else n)

    def _layers(self, tokens: np.ndarray, positions: np.ndarray, cache: KVCache) -> tuple:
        """Embedding and the layers over one micro-batch -> (hidden states, the backend holding them)."""
        off = self.op_offload
        if off is not None and off.wants(len(tokens)):  # the CPU layers on the GPU, their weights streamed
            with off.batch(self.backends, self.weights.layers) as (backends, layers):
                return self._run_layers(tokens, positions, cache, backends, layers)
        return self._run_layers(tokens, positions, cache, self.backends, self.weights.layers)

    def _run_layers(self, tokens: np.ndarray, positions: np.ndarray, cache: KVCache, backends: list,
                    layers: list) -> tuple:
        x = forward.embed(self.cpu, self.spec, self.config, self.weights, tokens)  # (n, n_embd) on the host
        prev = None
        for a, b, be in _runs(backends):  # the hidden state crosses devices once per change (CPU -> GPU in a split)
            x = be.from_host(prev.to_host(x) if prev is not None else x)
            if isinstance(be, CpuBackend) and self.op_offload is not None:  # a small batch: the CPU's or streamed
                x = self._cpu_run(a, b, x, positions, cache)
            else:
                x = forward.layers(self.spec, self.config, self.weights, backends, range(a, b), x, positions, cache,
                                   layers)
            prev = be
        return x, (prev if prev is not None else self.cpu)

    def _logits(self, h, where) -> np.ndarray:
        """Logits of hidden states h held by backend `where`; they cross to the host only if the output layer's
        backend is not on the same device (GPU backends, op offload's included, share the device's arrays)."""
        w = self.weights
        off = self.op_offload
        if off is not None and off.wants(h.shape[0]):  # a CPU output layer on the GPU, streamed
            with off.batch([self.output_backend], [{"output": w.output, "output_norm": w.output_norm}]) as (
                    [be], [head]):
                return self._head(be, head["output"], head["output_norm"], _move(h, where, be))
        return self._head(self.output_backend, w.output, w.output_norm, _move(h, where, self.output_backend))

    def _head(self, be, output, output_norm, h) -> np.ndarray:
        logits = be.to_host(forward.head(be, self.config, output, output_norm, be.from_host(h)))  # (n, n_vocab)
        return forward.softcap(self.config, logits)

    def _decode(self, tokens: np.ndarray, caches: list[KVCache], lengths: list[int],
                last: np.ndarray | None = None, beside: Callable[[], None] | None = None,
                ids_only: bool = False) -> np.ndarray:
        """A token (or a speculative check's few, GRAPH_MAX_TOKENS at most) at positions cache.n_past.. through the
        layers and the output layer -> logits (n, n_vocab); or, with several caches (paged, of one pool), one token
        of each, stacked (a ragged decode batch). Each run of layers on a GPU (with the output layer when it follows
        them there) is one decode_step of its backend: the hidden states cross to the GPU once, the run replays as
        a CUDA graph (one per batch size); paged caches send their positions and block tables with them. last: a
        mixed batch's (every layer and the output on one GPU, Engine._mixed_graph) rows whose logits are computed,
        one a sequence (their indices cross with the positions): logits (n_seq, n_vocab). beside(): run once, by
        the first GPU run once it is launched (or first, without one). ids_only: the rows' argmax ids (n,) int64
        instead of their logits; an output layer in a decode graph computes them there (GpuBackend.logits_and_ids)
        and only they cross to the host."""
        cfg, spec, w = self.config, self.spec, self.weights
        x = forward.embed(self.cpu, spec, cfg, w, np.asarray(tokens, dtype=np.int64))  # (n, n_embd) on the host
        cache = caches[0]
        positions = np.concatenate([np.arange(c.n_past, c.n_past + k, dtype=np.int32)
                                    for c, k in zip(caches, lengths, strict=True)])
        kv = cache if len(caches) == 1 else KVBatch.of(caches, lengths)
        paged = None
        if cache.paged:
            seq_of = np.repeat(np.arange(len(caches), dtype=np.int32), lengths)
            tables = np.stack([c.table for c in caches]).astype(np.int32)
            paged = (positions, seq_of, tables, cache.pool_of.block_size)
            if last is not None:
                paged += (np.asarray(last, dtype=np.int32),)
        runs = [[be, a, b, False] for a, b, be in _runs(self.backends)]  # [backend, first, end, with the output]
        if runs and runs[-1][0] is self.output_backend:
            runs[-1][3] = True
        else:
            runs.append([self.output_backend, cfg.n_layer, cfg.n_layer, True])
        if beside is not None and not any(hasattr(be, "decode_step") for be, *_ in runs):
            beside()
            beside = None

        n_rows = len(tokens) if last is None else len(last)  # the rows whose logits are computed

        def run_fn(be, a: int, b: int, with_output: bool, graph: bool = False):
            def run(h, pos, rows=None):  # rows: the device indices of `last` (a mixed batch)
                h = forward.layers(spec, cfg, w, self.backends, range(a, b), h, pos, kv)
                if rows is not None:
                    h = be.gather_rows(h, rows)
                if not with_output:
                    return h
                logits = forward.head(be, cfg, w.output, w.output_norm, h)
                return be.logits_and_ids(logits) if graph else logits  # [argmax ids | logits], flat
            return run

        in_graph = ids_crossed = False  # the output ran in a decode graph (x: its ids, then its logits, or the ids)
        for be, a, b, with_output in runs:
            if hasattr(be, "decode_step"):
                run = run_fn(be, a, b, with_output, graph=True)
                in_graph = with_output
                ids_crossed = with_output and ids_only and not cfg.final_logit_softcapping  # (else: argmax after it)
                x = be.decode_step((a, b, with_output), {il: cache.layers[il] for il in range(a, b)}, run, x,
                                   cache.n_past, paged=paged, beside=beside, head=n_rows if ids_crossed else None)
                beside = None
            elif self.op_offload is not None and a < b:  # CPU layers: the CPU's or streamed, the output after
                x = self._cpu_run(a, b, x, positions, kv)
                x = run_fn(be, b, b, with_output)(x, positions)
            else:
                x = run_fn(be, a, b, with_output)(x, positions)
        if ids_crossed:
            return x.astype(np.int64)
        if in_graph:
            x = x[n_rows:].reshape(n_rows, -1)
        logits = forward.softcap(cfg, x)
        return np.argmax(logits, axis=-1) if ids_only else logits

    def _cpu_run(self, a: int, b: int, x: np.ndarray, positions: np.ndarray, kv) -> np.ndarray:
        """CPU layers [a, b) over a batch below op offload's threshold: on the CPU, or with the layers' weights
        streamed to the GPU, as op offload's DecodeChoice measured faster for that many rows (a decode batch of
        several sequences; one row always runs on the CPU). Timed here, to the hidden state on the host."""
        off, n = self.op_offload, x.shape[0]
        streamed = off.decode.streamed(n)
        t0 = time.perf_counter()
        if not streamed:
            h = forward.layers(self.spec, self.config, self.weights, self.backends, range(a, b), x, positions, kv)
        else:
            with off.batch(self.backends, self.weights.layers, within=range(a, b)) as (backends, layers):
                h = forward.layers(self.spec, self.config, self.weights, backends, range(a, b),
                                   off.backend.from_host(x), positions, kv, layers)
                h = off.backend.to_host(h)
        off.decode.record(n, streamed, time.perf_counter() - t0)
        return h


def _ubatches(lengths: list[int], ub: int) -> list[list[tuple[int, int, int]]]:
    """Sequences of `lengths` tokens, stacked in order, cut into micro-batches of at most ub rows:
    [[(sequence, first token, end token), ...] per micro-batch]."""
    out: list[list[tuple[int, int, int]]] = [[]]
    room = ub
    for i, n in enumerate(lengths):
        a = 0
        while a < n:
            if room == 0:
                out.append([])
                room = ub
            b = min(n, a + room)
            out[-1].append((i, a, b))
            room -= b - a
            a = b
    return out


def _one_pool(caches: Sequence[KVCache]) -> bool:
    """Whether the caches are paged sequences of one pool (hybrid.kv.paged) with tables of one width."""
    first = caches[0]
    return first.paged and all(c.paged and c.pool_of is first.pool_of and c.table.shape == first.table.shape
                               for c in caches)


def _runs(backends: list) -> list[tuple[int, int, object]]:
    """Consecutive layers on one backend: [(first, end, backend)], in order."""
    runs: list[list] = []
    for il, be in enumerate(backends):
        if runs and runs[-1][2] is be:
            runs[-1][1] = il + 1
        else:
            runs.append([il, il + 1, be])
    return [tuple(r) for r in runs]


def _move(x, src, dst):
    """x from backend src to backend dst: through the host unless both keep arrays on the GPU."""
    if src is dst or (src.name.startswith("gpu") and dst.name.startswith("gpu")):
        return x
    return src.to_host(x)
