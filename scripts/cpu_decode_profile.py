#!/usr/bin/env python3
"""Where the time of one decode token goes on the CPU (every layer on the CPU).

    python3 scripts/cpu_decode_profile.py [MODEL.gguf] [-t THREADS] [--depth 32] [-n 32] [--ab 3] [--json OUT.json]

Pins the threads as `hybrid run` does, fills the cache to --depth, then times -n decode steps: the wall time per
token with the fused layers (CpuBackend's default) and op by op (fused off), alternating --ab times, then op by op
with each CpuBackend op timed: the wall time and each op (the calls wrapped with a timer), the matmuls split by
weight type and shape with the bytes they read and GB/s. The demo model is the default.

On an MoE model the MoE FFN is split into routing (the router's product and the top-k), experts (gate/up, GLU,
down) and reduction (the weighted sum): op by op from the timed CpuBackend ops and blocks.route; fused from
kernels_cpu.moe's steps timed inside one compiled call on each layer's input of a decode step, beside the time of
the fused call (the FFN half of the layer: x + a, the norm, the MoE FFN, the residual).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPS = ("matmul", "matmuls", "get_rows", "rms_norm", "add_rms_norm", "rms_norm_heads", "rope", "scale", "glu",
       "kv_store", "attention", "take_rows", "zeros", "scatter_add")
MOE_PART = {"route": "routing", "take_rows": "experts", "glu": "experts", "zeros": "reduction",
            "scatter_add": "reduction"}  # op-by-op MoE ops; matmuls: by the weight's name


def role(w) -> str:
    """A matmul key's suffix: which part of an MoE FFN a weight serves, if any."""
    return " (router)" if "ffn_gate_inp" in w.name else " (experts)" if "_exps" in w.name else ""


def moe_part(key: str) -> str | None:
    """The MoE part (routing, experts, reduction) an op-by-op timing key belongs to, or None."""
    if key.endswith("(router)"):
        return "routing"
    if key.endswith("(experts)"):
        return "experts"
    return MOE_PART.get(key.split()[0])


def moe_steps_timed():
    """kernels_cpu.moe.moe_ffn's steps for few tokens (an F32 router) with a monotonic clock read between them,
    compiled here: (n_threads, h, router, n_used, normalize, gate, up, down, empty, glu_op, table, ts int64 (4,),
    buf int64 (2,)) -> out, ts = ns at the start, after routing, after the experts, after the reduction."""
    import ctypes

    import numpy as np
    from numba import njit

    from kernels_cpu import moe, moe_route
    from kernels_cpu.quant_dot_float import matmul_f32

    clock_gettime = ctypes.CDLL(None).clock_gettime
    clock_gettime.argtypes, clock_gettime.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int

    @njit
    def now(buf):
        clock_gettime(1, buf.ctypes)  # CLOCK_MONOTONIC
        return buf[0] * 1000000000 + buf[1]

    @njit
    def steps(nt, h, router, n_used, normalize, gate, up, down, empty, glu_op, table, ts, buf):
        ts[0] = now(buf)
        logits = np.empty((h.shape[0], router.shape[0]), dtype=np.float32)
        matmul_f32(router, h, logits)
        ids, w = moe_route.route_topk(logits, n_used, normalize)
        ts[1] = now(buf)
        offsets, pair_tok, pair_of, used = moe_route.group_pairs(ids, gate[0].shape[0])
        n_pairs = pair_tok.shape[0]
        g = np.empty((n_pairs, gate[0].shape[1]), dtype=np.float32)
        u, act = np.empty_like(g), np.empty_like(g)
        none = np.empty((0, 0), dtype=np.float32)  # no biases, no second matrix
        moe._projection(nt, h, pair_tok, offsets, used, gate, up, g, u, act, glu_op, table, none, none)
        d = np.empty((n_pairs, down[0].shape[1]), dtype=np.float32)
        moe._projection(nt, act, np.arange(n_pairs), offsets, used, down, empty, d, none, none, glu_op, table, none,
                        none)
        ts[2] = now(buf)
        out = np.empty((h.shape[0], d.shape[1]), dtype=np.float32)
        moe._weighted_sum(ids, w, pair_of, d, out)
        ts[3] = now(buf)
        return out

    return steps


def fused_moe_parts(eng, n: int) -> dict[str, float]:
    """ms a token of the fused MoE FFN, summed over the layers, on each layer's input of one decode step: the fused
    call (CpuBackend.fused_ffn: x + a, the norm, the MoE FFN, the residual, from Python), and kernels_cpu.moe's
    steps on the normed input, timed inside one compiled call (moe_steps_timed: routing, experts, reduction)."""
    import numba
    import numpy as np

    from kernels_cpu.activations import GELU_F16_TABLE
    from hybrid.backends.cpu_moe import _EMPTY, _GLU_OP

    be, spec, cfg = eng.cpu, eng.spec, eng.config
    seen = []
    real = be.fused_ffn
    be.fused = True
    be.fused_ffn = lambda spec_, cfg_, lw, x, a: seen.append((lw, np.array(x), np.array(a))) or real(spec_, cfg_,
                                                                                                    lw, x, a)
    cache = eng.new_cache()
    eng.eval([5], cache)
    del be.fused_ffn
    steps, nt, times = moe_steps_timed(), numba.get_num_threads(), defaultdict(float)
    ts, buf = np.zeros(4, np.int64), np.zeros(2, np.int64)
    for rep in range(n + 1):  # the first round compiles
        for lw, x, a in seen:  # every layer, then every layer again: each finds its experts out of the caches
            t0 = time.perf_counter()
            be.fused_ffn(spec, cfg, lw, x, a)
            times["fused call"] += (time.perf_counter() - t0) * (rep > 0)
        for lw, x, a in seen:
            L = be._moe._layer(spec, cfg, lw)
            if L is None or L.router_f32 is None:
                continue
            _, h = be.add_rms_norm(x, a, lw["ffn_norm"].raw, cfg.f_norm_rms_eps)
            steps(nt, h, L.router_f32, cfg.n_expert_used, spec.moe_norm_weights, L.gate, L.up, L.down, _EMPTY,
                  _GLU_OP[spec.ffn_act], GELU_F16_TABLE, ts, buf)
            for i, part in enumerate(("routing", "experts", "reduction")):
                times[part] += (ts[i + 1] - ts[i]) * 1e-9 * (rep > 0)
    return {k: 1000 * v / n for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--ab", type=int, default=3, help="rounds of fused vs op by op, untimed, alternating")
    a = ap.parse_args()

    from hybrid.backends.cpu import CpuBackend
    from hybrid.engine import Engine, EngineParams
    from hybrid.model.files import demo_model_path
    from hybrid.system.threads import setup_threads

    threads = setup_threads(a.threads)
    eng = Engine.load(a.model or demo_model_path(), EngineParams(n_ctx=max(256, a.depth + a.n + 8)))
    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    enabled = [False]

    def wrap(name, fn):
        def timed(self, *args, **kw):
            if not enabled[0]:
                return fn(self, *args, **kw)
            t0 = time.perf_counter()
            out = fn(self, *args, **kw)
            dt = time.perf_counter() - t0
            key = name
            if name == "matmul":
                w = args[0]
                key = f"matmul {w.type_name} {w.shape[0]}x{w.shape[1]}{role(w)}"
                nbytes[key] += w.raw.nbytes
            elif name == "matmuls":  # several weights times one x (q/k/v, gate/up)
                key = "matmuls " + " + ".join(f"{w.type_name} {w.shape[0]}x{w.shape[1]}" for w in args[0])
                key += role(args[0][0])
                nbytes[key] += sum(w.raw.nbytes for w in args[0])
            times[key] += dt
            calls[key] += 1
            return out
        return timed

    for op in OPS:
        setattr(CpuBackend, op, wrap(op, getattr(CpuBackend, op)))
    from hybrid.model.arch import blocks

    route = blocks.route
    blocks.route = lambda *args: wrap("route", lambda _, *a: route(*a))(None, *args)  # the host routing (numpy)

    def untimed_ms(fused: bool) -> float:  # the wall time per token, no op timed; fused: CpuBackend's default path
        eng.cpu.fused = fused
        cache = eng.new_cache()
        eng.eval(list(range(3, 3 + a.depth)), cache)
        eng.eval([5], cache)
        t0 = time.perf_counter()
        for _ in range(a.n):
            eng.eval([5], cache)
        return 1000 * (time.perf_counter() - t0) / a.n

    walls = {True: [], False: []}
    for _ in range(a.ab):  # fused and op by op alternating: this machine drifts between runs
        for fused in (False, True):
            walls[fused].append(untimed_ms(fused))
    fused_wall, plain_wall = statistics.median(walls[True]), statistics.median(walls[False])
    eng.cpu.fused = False  # the breakdown below times the ops one by one
    cache = eng.new_cache()
    eng.eval(list(range(3, 3 + a.depth)), cache)
    eng.eval([5], cache)  # compile/warm
    wall = []
    enabled[0] = True
    for _ in range(a.n):
        t0 = time.perf_counter()
        eng.eval([5], cache)
        wall.append(time.perf_counter() - t0)
    enabled[0] = False
    n = a.n
    wall_ms = 1000 * sum(wall) / n
    rows = sorted(times, key=times.get, reverse=True)
    total_w = sum(nbytes.values()) / n
    print(f"{threads.describe()}; model {Path(eng.gguf.path).name if hasattr(eng.gguf, 'path') else ''}")
    print(f"fused layers (the default): {fused_wall:.2f} ms a token ({1000 / fused_wall:.1f} t/s); op by op "
          f"{plain_wall:.2f} ms: {plain_wall / fused_wall:.3f}x (medians of {a.ab}, alternating)")
    print("op by op, each op timed:")
    print(f"token: {wall_ms:.2f} ms wall ({1000 / wall_ms:.1f} t/s), depth {a.depth}; weights read "
          f"{total_w / 1e9:.3f} GB a token = {total_w / (wall_ms / 1000) / 1e9:.1f} GB/s over the whole token")
    print(f"{'op':40s} {'calls':>6s} {'us/call':>9s} {'ms/token':>9s} {'GB/s':>7s}")
    out_rows = []
    for k in rows:
        ms = 1000 * times[k] / n
        gbs = nbytes[k] / times[k] / 1e9 if nbytes.get(k) else None
        print(f"{k:40s} {calls[k] // n:6d} {1e6 * times[k] / calls[k]:9.1f} {ms:9.3f} "
              f"{'' if gbs is None else f'{gbs:7.1f}'}")
        out_rows.append({"op": k, "calls": calls[k] // n, "ms_per_token": ms, "gb_per_s": gbs})
    other = wall_ms - 1000 * sum(times.values()) / n
    print(f"{'(between ops: Python, residual adds)':40s} {'':6s} {'':9s} {other:9.3f}")
    moe_ms: dict[str, float] = {}
    if eng.spec.moe:
        for k in rows:
            part = moe_part(k)
            if part:
                moe_ms[part] = moe_ms.get(part, 0.0) + 1000 * times[k] / n
        fused_parts = fused_moe_parts(eng, n)
        print(f"MoE FFN, ms a token over {eng.config.n_layer} layers ({eng.config.n_expert_used} of "
              f"{eng.config.n_expert} experts):")
        print(f"{'part':12s} {'op by op':>9s} {'fused':>9s}")
        for part in ("routing", "experts", "reduction"):
            print(f"{part:12s} {moe_ms.get(part, 0.0):9.3f} {fused_parts.get(part, 0.0):9.3f}")
        call = fused_parts.get("fused call", 0.0)
        steps = sum(fused_parts.get(p, 0.0) for p in ("routing", "experts", "reduction"))
        print(f"{'total':12s} {sum(moe_ms.values()):9.3f} {steps:9.3f}   (the fused call: {call:.3f} ms, "
              f"{1000 * call / eng.config.n_layer:.0f} us a layer)")
        moe_ms = {**{f"op_by_op_{k}": v for k, v in moe_ms.items()},
                  **{f"fused_{k}": v for k, v in fused_parts.items()}}
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": threads.n_threads, "fused_ms_per_token": fused_wall,
                                            "op_by_op_ms_per_token": plain_wall, "wall_ms_per_token": wall_ms,
                                            "ops": out_rows, "between_ops_ms": other, "moe_ms": moe_ms}, indent=1))


if __name__ == "__main__":
    main()
