"""Per-call times of the integer-dot matmuls for small batches (1, 2, 4, 8, 16 tokens: decode of several sequences,
speculative checks) on the demo model's matrices as decode runs them: the tied output (Q8_0 -> Q8_0_X8, and in the
file's layout for comparison), and of layer 0 ffn_gate (Q5_0 -> Q5_0_X8), attn_output (Q4_K -> Q4_K_X8), ffn_down
(Q6_K, from a layer that has it) and attn_v (Q8_0 -> Q8_0_X8), plus a random Q4_0 matrix repacked to Q4_0_X8. Best
of --reps calls, repeated --rounds times.

usage: python scripts/bench_small_batch.py [--model PATH] [--tokens 1,2,4,8,16] [--reps 3] [--rounds 3]
                                           [--only NAME ...]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_cpu import legacy_x8, q4_k_x8, q8_0_x8  # noqa: E402
from kernels_cpu.matmul import matmul  # noqa: E402

DEMO = Path.home() / ".cache/hybrid/gemma-3-270m-q4_k_m.gguf"


def demo_matrices(path):
    """name -> (raw uint8 (n_out, row_bytes), type name as decode runs it)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    t = {x.name: x for x in r.tensors}

    def raw(name):
        return np.ascontiguousarray(np.asarray(t[name].data, dtype=np.uint8))

    down6 = next(n for n, x in t.items() if n.endswith("ffn_down.weight") and x.tensor_type.name == "Q6_K")
    v8 = next(n for n, x in t.items() if n.endswith("attn_v.weight") and x.tensor_type.name == "Q8_0")
    rng = np.random.default_rng(0)
    q40 = rng.integers(0, 256, (2048, 20, 18), dtype=np.uint8)
    q40[:, :, 0:2] = rng.uniform(0.01, 0.05, (2048, 20, 1)).astype("<f2").view(np.uint8)
    return {
        "output Q8_0_X8 (262144x640)": (q8_0_x8.repack(raw("token_embd.weight")), "Q8_0_X8"),
        "output Q8_0, file layout (262144x640)": (np.asarray(t["token_embd.weight"].data, dtype=np.uint8), "Q8_0"),
        "ffn_gate Q5_0_X8 (2048x640)": (legacy_x8.repack_q5_0(raw("blk.0.ffn_gate.weight")), "Q5_0_X8"),
        "attn_output Q4_K_X8 (640x1024)": (q4_k_x8.repack(raw("blk.0.attn_output.weight")), "Q4_K_X8"),
        f"ffn_down Q6_K (640x2048, {down6.split('.')[1]})": (raw(down6), "Q6_K"),
        f"attn_v Q8_0_X8 (256x640, {v8.split('.')[1]})": (q8_0_x8.repack(raw(v8)), "Q8_0_X8"),
        "random Q4_0_X8 (2048x640)": (legacy_x8.repack_q4_0(q40.reshape(2048, -1)), "Q4_0_X8"),
    }


def best_ms(w, type_name, x, reps):
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    matmul(w, type_name, x, out)  # compile / warm up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        matmul(w, type_name, x, out)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the matrix names to run")
    args = ap.parse_args()
    tokens = [int(n) for n in args.tokens.split(",")]
    mats = demo_matrices(args.model)
    rng = np.random.default_rng(1)
    print("matrix | " + " | ".join(f"{n} tok ms" for n in tokens) + " | 4 tok / 1 tok")
    for name, (w, type_name) in mats.items():
        if args.only and not any(s in name for s in args.only):
            continue
        n_in = x_width(w, type_name)
        per_n = {}
        for n in tokens:
            x = rng.standard_normal((n, n_in)).astype(np.float32)
            per_n[n] = [best_ms(w, type_name, x, args.reps) for _ in range(args.rounds)]
        cells = [f"{min(v):.3f}-{max(v):.3f}" for v in per_n.values()]
        ratio = f"{min(per_n[4]) / min(per_n[1]):.2f}" if 1 in per_n and 4 in per_n else "-"
        print(f"{name} | " + " | ".join(cells) + f" | {ratio}", flush=True)


def x_width(w, type_name):
    from kernels_cpu.matmul import _kernel

    k = _kernel(type_name)
    return w.shape[1] // k.type_size * k.block_size


if __name__ == "__main__":
    main()
