#!/usr/bin/env python3
"""hybrid serve's host side under load, without a GPU: a real server (HTTP, batched worker, paged scheduler,
tokenizer, text filters) over MODEL whose Engine.eval_batch is a stand-in that sleeps as a GPU step would (the
interpreter lock released, as while a CUDA graph runs): --step-ms a step, plus --per-seq-ms a sequence beyond the
first and --per-token-ms a prompt token beyond one a sequence, then hands back either each greedy sequence's id
(eval_batch's ids) or logits whose largest value is a pseudo-random token that ends nothing. Load it with
scripts/bench_serve.py --url URL: the time per output token above the sleep is the server's own, and its /metrics
show where the worker spends it. (The stand-in runs eval_batch's `beside` before its sleep; the GPU engine runs it
once the step is launched.)

    python3 scripts/serve_stand_in.py [-m smollm2] [-np 8] [--step-ms 6.4] [--per-seq-ms 0] [--per-token-ms 0.1]
                                      [--port 8095]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np


def stand_in(engine, step_ms: float, per_token_ms: float, per_seq_ms: float = 0.0, seed: int = 0):
    """An eval_batch with the real one's contract (blocks reserved, positions advanced, want / ids / beside kept)
    whose computation is a sleep."""
    rng = np.random.default_rng(seed)
    n_vocab = engine.config.n_vocab
    ok = np.array([not engine.tokenizer.is_eog(i) for i in range(n_vocab)])
    ok[: min(200, n_vocab // 2)] = False  # no control tokens either
    choices = np.flatnonzero(ok)

    def eval_batch(seqs, want=None, beside=None, ids=None):
        want = [True] * len(seqs) if want is None else list(want)
        ids = [False] * len(seqs) if ids is None else list(ids)
        n_tok = 0
        for tokens, cache in seqs:
            cache.reserve(cache.n_past + len(tokens))
            n_tok += len(tokens)
        if beside is not None:
            beside()
        time.sleep((step_ms + per_seq_ms * (len(seqs) - 1) + per_token_ms * (n_tok - len(seqs))) / 1000)
        out = []
        for (tokens, cache), w, i in zip(seqs, want, ids):
            cache.n_past += len(tokens)
            tok = int(rng.choice(choices))
            if not w:
                out.append(None)
            elif i:
                out.append(tok)
            else:
                logits = np.zeros(n_vocab, np.float32)
                logits[tok] = 10.0
                out.append(logits)
        return out

    return eval_batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2", help="a GGUF file or a known model's name (its tokenizer)")
    ap.add_argument("-np", "--parallel", type=int, default=8)
    ap.add_argument("-c", "--ctx-size", type=int, default=16384)
    ap.add_argument("--step-ms", type=float, default=6.4, help="a step's sleep (the B = 8 GPU step: ~5-6 ms)")
    ap.add_argument("--per-token-ms", type=float, default=0.1, help="and this much a prompt token beyond the first")
    ap.add_argument("--per-seq-ms", type=float, default=0.0, help="and this much a sequence beyond the first")
    ap.add_argument("--port", type=int, default=8095)
    a = ap.parse_args()
    from hybrid.engine.launch import launch  # noqa: PLC0415
    from hybrid.engine.params import EngineParams  # noqa: PLC0415
    from hybrid.model.files import default_cache_dir, resolve_model  # noqa: PLC0415
    from hybrid.server.running import BackgroundServer  # noqa: PLC0415
    from hybrid.server.state import ServerConfig, ServerState  # noqa: PLC0415

    from hybrid.errors import HybridError  # noqa: PLC0415

    try:
        path = resolve_model(a.model, default_cache_dir())
        engine, _ = launch(Path(path), EngineParams(n_ctx=a.ctx_size), default_cache_dir(), lambda msg: None)
    except HybridError as exc:  # a missing or bad model file: one line, as hybrid's commands say it
        print(f"error: {exc}", file=sys.stderr)
        return 1
    engine.eval_batch = stand_in(engine, a.step_ms, a.per_token_ms, a.per_seq_ms)
    state = ServerState(ServerConfig(alias="stand-in", n_parallel=a.parallel))
    state.attach(engine)
    with BackgroundServer(state, "127.0.0.1", a.port) as server:
        print(f"stand-in engine ({a.step_ms} ms a step) serving {path.name} on {server.url}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
