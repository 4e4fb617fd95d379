"""Engine: a loaded model (config, weights, tokenizer, a backend per layer) that evaluates tokens and generates.

Prefill runs the prompt in micro-batches of -ub tokens, layer by layer on each layer's device; decode runs one
token at a time. Per-conversation state (the KV cache) is passed in, never kept here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from gguf_io import GGUFFile, ModelConfig, open_gguf

from hybrid.model.arch import arch_spec
from hybrid.model.arch.blocks import layer_forward
from hybrid.model.arch.spec import LAYER_TENSORS_DENSE, LAYER_TENSORS_MOE, ArchSpec
from hybrid.backends.cpu import CpuBackend
from hybrid.errors import ContextTooLarge, HybridError
from hybrid.kv.cache import KVCache
from hybrid.kv.types import check_kv_types
from hybrid.system.memlock import prepare_cpu_weights
from hybrid.system.numa import check_mode as check_numa_mode
from hybrid.system.numa import memory_policy
from hybrid.backends.op_offload import gpu_overhead_bytes, make_op_offload
from hybrid.plan.placement import PlacementPlan, plan
from hybrid.backends.repack import repack_weights
from hybrid.generate.sampling import Sampler, SamplingParams
from hybrid.text.tokenizer import Tokenizer
from hybrid.model.weights import ModelWeights, check_layers, load_weights


@dataclass(frozen=True)
class EngineParams:
    n_ctx: int = 4096  # -c; 0 = the model's training context
    n_batch: int = 2048  # -b: logical batch (how many prompt tokens one eval call takes)
    n_ubatch: int = 512  # -ub: physical micro-batch through the layers
    type_k: str = "f16"  # -ctk
    type_v: str = "f16"  # -ctv
    n_threads: int = 0  # -t; 0 = physical cores
    n_gpu_layers: str = "0"  # -ngl: N (repeating layers + output, as llama.cpp), "auto" or "all"
    vram_budget: int | None = None  # --vram-budget in bytes; None = the device's free memory
    flash_attn: bool = True  # -fa (our attention kernels are always flash-style; counted in the plan)
    use_mmap: bool = True  # --no-mmap: False reads the file into anonymous memory
    use_mlock: bool = False  # --mlock: lock the CPU-resident weights in RAM
    numa: str = ""  # --numa distribute|isolate|numactl ("" = off)
    cpus: tuple[int, ...] = ()  # -C/--cpu-mask, --cpu-range: the CPUs the workers are pinned to (() = all allowed)
    # op offload: big prefill batches run the CPU layers on the GPU, weights streamed (hybrid/offload.py). The CLI
    # turns it on (llama.cpp's default; --no-op-offload); off here, so a library caller's -ngl 0 stays on the CPU.
    op_offload: bool = False
    repack: bool = True  # --no-repack: False keeps the CPU layers' matrices as in the file (hybrid/repack.py)


@dataclass
class Timings:
    load_ms: float = 0.0
    prompt_ms: float = 0.0
    prompt_tokens: int = 0
    eval_ms: float = 0.0
    eval_tokens: int = 0  # generated tokens that went through the model (llama.cpp's "eval" count)
    sample_ms: float = 0.0

    @staticmethod
    def rate(n: int, ms: float) -> float:
        return 1000.0 * n / ms if ms > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "load_ms": self.load_ms,
            "prompt_n": self.prompt_tokens, "prompt_ms": self.prompt_ms,
            "prompt_per_second": self.rate(self.prompt_tokens, self.prompt_ms),
            "predicted_n": self.eval_tokens, "predicted_ms": self.eval_ms,
            "predicted_per_second": self.rate(self.eval_tokens, self.eval_ms),
            "sample_ms": self.sample_ms,
        }


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
    op_offload: object = None  # hybrid.offload.OpOffload when big batches of CPU layers run on the GPU

    @classmethod
    def load(cls, path: str | Path, params: EngineParams = EngineParams(),
             progress: Callable[[str], None] | None = None, placeholder_weights: bool = False) -> "Engine":
        """Open the GGUF (memory-mapped), check it holds what its architecture needs, and set up the backends.

        placeholder_weights (for `hybrid probe`): GPU layers get uninitialized buffers of their real sizes instead
        of an upload, and the plan's own budget check is lifted so the device's allocator decides what fits.
        """
        check_kv_types(params.type_k, params.type_v)
        check_numa_mode(params.numa)
        f = open_gguf(path, use_mmap=params.use_mmap)
        try:
            config = ModelConfig.from_gguf(f)
            spec = arch_spec(config.arch)
            weights = load_weights(f, config)
            check_layers(weights, LAYER_TENSORS_MOE if spec.moe else LAYER_TENSORS_DENSE, config.arch)
            tokenizer = Tokenizer.from_metadata(f.metadata)
        except BaseException:
            f.close()
            raise
        n_ctx = params.n_ctx or config.n_ctx_train
        if n_ctx > config.n_ctx_train > 0:
            if progress:
                progress(f"warning: -c {n_ctx} is larger than the model's training context {config.n_ctx_train}")
        params = replace(params, n_ctx=n_ctx, n_ubatch=min(params.n_ubatch, params.n_batch))
        cpu = CpuBackend()
        engine = cls(f, config, spec, weights, tokenizer, params, [cpu] * config.n_layer, cpu)
        try:
            if str(params.n_gpu_layers) not in ("0", ""):
                engine._offload(progress, placeholder_weights)
            if params.op_offload:
                engine.op_offload = make_op_offload(engine.backends, engine.output_backend, config, f.tensors, n_ctx,
                                                    params.n_ubatch, params.type_k, params.type_v, params.flash_attn,
                                                    params.vram_budget, progress)
            if params.repack and engine.op_offload is None:  # op offload streams the CPU layers' blocks as they are
                engine._repack(progress)
        except BaseException:
            f.close()
            raise
        notes, _ = prepare_cpu_weights(engine.weights.host_arrays(), params.numa, params.use_mlock)  # after the GPU took its layers
        for msg in notes:
            if progress:
                progress(msg)
        return engine

    def _repack(self, progress: Callable[[str], None] | None) -> None:
        """The CPU layers' matrices into the 8-row interleaved layouts (hybrid/repack.py)."""
        cpu_layers = [il for il, be in enumerate(self.backends) if isinstance(be, CpuBackend)]
        on_cpu = isinstance(self.output_backend, CpuBackend)
        try:
            with memory_policy(self.params.numa):  # the copies' pages follow --numa as they are first written
                done = repack_weights(self.weights, cpu_layers, on_cpu)
        except OSError:  # the policy was refused (prepare_cpu_weights says so): the copies stay where they fall
            done = repack_weights(self.weights, cpu_layers, on_cpu)
        if done.n_matrices and progress:
            progress(f"repack: {done.n_matrices} matrices ({', '.join(done.types)}) interleaved by 8 rows for the "
                     f"CPU ({done.n_bytes / 2**20:.1f} MiB)")

    def _offload(self, progress: Callable[[str], None] | None, placeholder: bool = False) -> None:
        """Plan the split (KV cache first, then the output layer, then layers from the last one backwards) and
        upload the GPU layers' quantized blocks as they are."""
        from hybrid.backends.gpu import GpuBackend  # noqa: PLC0415 - CuPy is optional

        p, cfg = self.params, self.config
        gpu = GpuBackend()
        budget = p.vram_budget if p.vram_budget is not None else gpu.free_bytes()
        gpu.limit_memory(budget)
        ngl = p.n_gpu_layers if p.n_gpu_layers in ("auto", "all") else int(p.n_gpu_layers)
        overhead = gpu_overhead_bytes(cfg, self.gguf.tensors, p.n_ctx, p.n_ubatch, p.type_k, p.type_v, p.flash_attn,
                                      p.op_offload, ngl)  # op offload's stream buffers where layers stay on the CPU
        # our cache holds n_ctx cells in sliding-window layers too (swa_full)
        self.placement = plan(cfg, self.gguf.tensors, (1 << 62) if placeholder else budget, ngl, p.n_ctx, p.type_k,
                              p.type_v, p.n_ubatch, p.flash_attn, swa_full=True, overhead_bytes=overhead)
        upload = gpu.alloc_like if placeholder else gpu.upload
        for lp in self.placement.layers:
            if lp.device == "gpu":
                self.weights.layers[lp.index] = {k: upload(w) for k, w in self.weights.layers[lp.index].items()}
                self.backends[lp.index] = gpu
        if self.placement.output.device == "gpu":
            self.weights.output = upload(self.weights.output)
            self.weights.output_norm = upload(self.weights.output_norm)
            self.output_backend = gpu
        if progress:
            pl = self.placement
            progress(f"offloaded {pl.n_gpu_layers}/{cfg.n_layer + 1} layers to the GPU "
                     f"({pl.gpu_total_bytes / 2**30:.2f} GiB of a {budget / 2**30:.2f} GiB budget)")

    @property
    def _cpu(self) -> CpuBackend:
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

    def run_gpu_layers(self, cache: KVCache, rng: np.random.Generator, n_tokens: int) -> None:
        """Run n_tokens random hidden states through the GPU layers and the output layer if it is on the GPU
        (what `hybrid probe` needs to see the real peak memory; the CPU layers do not touch the VRAM)."""
        gpu_layers = [il for il, be in enumerate(self.backends) if be is not self._cpu]
        if not gpu_layers:
            return
        be = self.backends[gpu_layers[0]]
        x = be.from_host(rng.standard_normal((n_tokens, self.config.n_embd)).astype(np.float32))
        positions = np.arange(cache.n_past, cache.n_past + n_tokens, dtype=np.int32)
        for il in gpu_layers:
            x = layer_forward(be, self.spec, self.config, self.weights.layers[il], il, x, positions, cache)
        if self.output_backend is be:
            be.matmul(self.weights.output, be.rms_norm(x, self.weights.output_norm.raw, self.config.f_norm_rms_eps))
        cache.n_past += n_tokens

    def new_cache(self, n_ctx: int | None = None) -> KVCache:
        return KVCache.create(self.config, self.backends, n_ctx or self.params.n_ctx,
                              self.params.type_k, self.params.type_v)

    def eval(self, tokens: list[int] | np.ndarray, cache: KVCache, logits_from: int | None = None) -> np.ndarray:
        """Append `tokens` at positions cache.n_past.. and return logits (float32).

        logits_from=None: only the last token's logits (n_vocab,); else the logits of tokens[logits_from:]
        as (n, n_vocab).
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        n = tokens.shape[0]
        if n == 0:
            raise HybridError("nothing to evaluate: the token list is empty")
        if cache.n_past + n > cache.n_ctx:
            raise ContextTooLarge(
                f"{cache.n_past + n} tokens do not fit the context of {cache.n_ctx} (-c); raise -c or shorten the input"
            )
        if tokens.min() < 0 or tokens.max() >= self.config.n_vocab:
            raise HybridError(f"token id out of range [0, {self.config.n_vocab})")
        if n == 1 and any(hasattr(b, "decode_step") for b in (*self.backends, self.output_backend)):
            logits = self._decode(int(tokens[0]), cache)  # (1, n_vocab): GPU runs replayed as CUDA graphs
            cache.n_past += 1
            return logits[-1] if logits_from is None else logits
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

    def _layers(self, tokens: np.ndarray, positions: np.ndarray, cache: KVCache) -> tuple:
        """The layers over one micro-batch -> (hidden states, the backend holding them)."""
        off = self.op_offload
        if off is not None and off.wants(len(tokens)):  # the CPU layers on the GPU, their weights streamed
            with off.batch(self.backends, self.weights.layers) as (backends, layers):
                return self._run_layers(tokens, positions, cache, backends, layers)
        return self._run_layers(tokens, positions, cache, self.backends, self.weights.layers)

    def _run_layers(self, tokens: np.ndarray, positions: np.ndarray, cache: KVCache, backends: list,
                    layers: list) -> tuple:
        cfg, spec = self.config, self.spec
        x = self._cpu.get_rows(self.weights.token_embd, tokens)  # (n, n_embd), the embedding stays on the CPU
        if spec.embd_scale:
            x = x * np.float32(np.sqrt(cfg.n_embd))
        prev = None
        for il, be in enumerate(backends):
            if be is not prev:  # the hidden state crosses devices once per change (CPU -> GPU in a split)
                x = be.from_host(prev.to_host(x) if prev is not None else x)
                prev = be
            x = layer_forward(be, spec, cfg, layers[il], il, x, positions, cache)
        return x, (prev if prev is not None else self._cpu)

    def _logits(self, h, where) -> np.ndarray:
        """Logits of hidden states h held by backend `where`; they cross to the host only if the output layer's
        backend is not on the same device (GPU backends, op offload's included, share the device's arrays)."""
        head = {"output": self.weights.output, "output_norm": self.weights.output_norm}
        off = self.op_offload
        if off is not None and off.wants(h.shape[0]):  # a CPU output layer on the GPU, streamed
            with off.batch([self.output_backend], [head]) as ([be], [head]):
                return self._head(be, head, self._move(h, where, be))
        return self._head(self.output_backend, head, self._move(h, where, self.output_backend))

    @staticmethod
    def _move(x, src, dst):
        """x from backend src to backend dst: through the host unless both keep arrays on the GPU."""
        if src is dst or (src.name.startswith("gpu") and dst.name.startswith("gpu")):
            return x
        return src.to_host(x)

    def _head(self, be, head: dict, h: np.ndarray) -> np.ndarray:
        h = be.rms_norm(be.from_host(h), head["output_norm"].raw, self.config.f_norm_rms_eps)
        logits = be.to_host(be.matmul(head["output"], h))  # (n, n_vocab)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = np.tanh(logits / cap) * cap
        return logits

    def _decode(self, token: int, cache: KVCache) -> np.ndarray:
        """One token at position cache.n_past through the layers and the output layer -> logits (1, n_vocab).
        Each run of layers on a GPU (with the output layer when it follows them there) is one decode_step of its
        backend: the hidden state crosses to the GPU once, the run replays as a CUDA graph."""
        cfg, spec, w = self.config, self.spec, self.weights
        x = self._cpu.get_rows(w.token_embd, np.array([token], dtype=np.int64))  # (1, n_embd) on the CPU
        if spec.embd_scale:
            x = x * np.float32(np.sqrt(cfg.n_embd))
        runs: list[list] = []  # [backend, first layer, end layer, with the output layer]
        for il, be in enumerate(self.backends):
            if runs and runs[-1][0] is be:
                runs[-1][2] = il + 1
            else:
                runs.append([be, il, il + 1, False])
        if runs and runs[-1][0] is self.output_backend:
            runs[-1][3] = True
        else:
            runs.append([self.output_backend, cfg.n_layer, cfg.n_layer, True])

        def run_fn(be, a: int, b: int, with_output: bool):
            def run(h, positions):
                for il in range(a, b):
                    h = layer_forward(be, spec, cfg, w.layers[il], il, h, positions, cache)
                if with_output:
                    h = be.matmul(w.output, be.rms_norm(h, w.output_norm.raw, cfg.f_norm_rms_eps))
                return h
            return run

        for be, a, b, with_output in runs:
            run = run_fn(be, a, b, with_output)
            if hasattr(be, "decode_step"):
                x = be.decode_step((a, b, with_output), {il: cache.layers[il] for il in range(a, b)}, run, x,
                                   cache.n_past)
            else:
                x = run(x, np.array([cache.n_past], dtype=np.int32))
        cap = cfg.final_logit_softcapping
        return np.tanh(x / cap) * cap if cap else x

    def generate(self, prompt: list[int], sampling: SamplingParams, n_predict: int, cache: KVCache,
                 timings: Timings | None = None) -> Iterator[int]:
        """Evaluate the prompt (appended to what the cache holds), then sample up to n_predict tokens
        (-1: until the context is full), stopping at an end-of-generation token (not yielded)."""
        timings = timings if timings is not None else Timings()
        sampler = Sampler(sampling)
        history = list(prompt)
        t0 = time.perf_counter()
        logits = None
        for s in range(0, len(prompt), self.params.n_batch):
            logits = self.eval(prompt[s : s + self.params.n_batch], cache)
        timings.prompt_ms += 1000 * (time.perf_counter() - t0)
        timings.prompt_tokens += len(prompt)
        if logits is None:
            raise HybridError("the prompt is empty")
        produced = 0
        while n_predict < 0 or produced < n_predict:
            t0 = time.perf_counter()
            tok = sampler.sample(logits, history)
            timings.sample_ms += 1000 * (time.perf_counter() - t0)
            if self.tokenizer.is_eog(tok):
                return
            yield tok
            produced += 1
            history.append(tok)
            if (n_predict >= 0 and produced >= n_predict) or cache.n_past >= cache.n_ctx:
                return
            t0 = time.perf_counter()
            logits = self.eval([tok], cache)
            timings.eval_ms += 1000 * (time.perf_counter() - t0)
            timings.eval_tokens += 1
