#!/usr/bin/env python3
"""Ours next to llama.cpp in one run: `hybrid bench` and llama.cpp (through llama-cpp-python) on the same model,
the same tests (pp N: one batch of N prompt tokens from an empty cache; tg N: N one-token steps from an empty
cache, as llama-bench), thread counts and repetitions, alternating the two so that both see the same machine;
each runs in a process of its own.

    pip install llama-cpp-python   # builds llama.cpp from source (a few minutes); or --llamacpp-path DIR
    python3 scripts/bench_vs_llamacpp.py [-m MODEL] [-p 512] [-n 128] [-t 1,2] [-r 10] [-ctk f16]
    python3 scripts/bench_vs_llamacpp.py --llama-bench build/bin/llama-bench -m MODEL -p 0 -n 64 -r 3

With --llama-bench, llama.cpp's own llama-bench binary (-fa 1, same tests) measures llama.cpp instead.

Prints a markdown table: t/s mean ± sd for each, and ours / llama.cpp. The demo model is the default.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def llamacpp_runs(model: str, n_prompt: int, n_gen: int, threads: int, reps: int, type_kv: str) -> dict:
    """t/s samples of llama.cpp: pp (one batch of n_prompt tokens) and tg (n_gen one-token steps), after a
    warm-up of each; the cache is emptied before every repetition, as llama-bench does."""
    import llama_cpp  # noqa: PLC0415

    ggml_type = {"f16": 1, "q8_0": 8, "q4_0": 2}[type_kv]
    llm = llama_cpp.Llama(model, n_ctx=max(512, n_prompt + n_gen + 16), n_batch=max(n_prompt, 1),
                          n_ubatch=max(n_prompt, 1), n_threads=threads, n_threads_batch=threads, verbose=False,
                          flash_attn=True, type_k=ggml_type, type_v=ggml_type)
    vocab = llm.n_vocab()
    prompt = [(7 * i + 11) % vocab for i in range(n_prompt)]
    out = {"pp": [], "tg": []}

    def pp() -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        return n_prompt / (time.perf_counter() - t0)

    def tg() -> float:
        llm.reset()
        t0 = time.perf_counter()
        for i in range(n_gen):
            llm.eval([(13 * i + 5) % vocab])
        return n_gen / (time.perf_counter() - t0)

    if n_prompt:
        pp()
        out["pp"] = [pp() for _ in range(reps)]
    if n_gen:
        tg()
        out["tg"] = [tg() for _ in range(reps)]
    llm.close() if hasattr(llm, "close") else None
    return out


def _add_path(path: str | None) -> None:
    if path:
        sys.path.insert(0, path)


def llamacpp_isolated(llamacpp_path: str | None, *args) -> dict:
    """llamacpp_runs in a process of its own: its worker threads end with it, so none is left spinning (or
    holding memory) while ours run; on 2 cores that once cost our 2-thread tg 12%."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=_add_path, initargs=(llamacpp_path,)) as pool:
        return pool.submit(llamacpp_runs, *args).result()


def llama_bench_runs(binary: str, model: str, n_prompt: int, n_gen: int, threads: int, reps: int,
                     type_kv: str) -> dict:
    """The same samples from llama.cpp's llama-bench binary (flash attention on, as ours; its own warm-up)."""
    cmd = [binary, "-m", model, "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads), "-r", str(reps),
           "-fa", "1", "-ctk", type_kv, "-ctv", type_kv, "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    out = {"pp": [], "tg": []}
    for r in rows:
        if r["n_prompt"] or r["n_gen"]:
            out["pp" if r["n_prompt"] else "tg"] = r["samples_ts"]
    return out


def ours(model: str, n_prompt: int, n_gen: int, threads: int, reps: int, type_kv: str) -> dict:
    cmd = [sys.executable, "-m", "hybrid", "bench", "-m", model, "-p", str(n_prompt), "-n", str(n_gen), "-t",
           str(threads), "-r", str(reps), "-ctk", type_kv, "-ctv", type_kv, "-o", "json"]
    rows = json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    out = {"pp": [], "tg": []}
    for r in rows:
        out["pp" if r["n_prompt"] else "tg"] = r["samples_ts"]
    return out


def fmt(xs: list[float]) -> str:
    if not xs:
        return "–"
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", default="1,2")
    ap.add_argument("-r", type=int, default=10)
    ap.add_argument("-ctk", default="f16", choices=["f16", "q8_0", "q4_0"])
    ap.add_argument("--llamacpp-path", help="a folder holding the llama_cpp package (pip install --target DIR)")
    ap.add_argument("--llama-bench", metavar="PATH", help="measure llama.cpp with this llama-bench binary instead "
                    "of llama-cpp-python")
    a = ap.parse_args()
    from hybrid.model.files import demo_model_path  # noqa: PLC0415

    model = a.model or str(demo_model_path())
    if a.llama_bench:
        version = subprocess.run([a.llama_bench, "--version"], capture_output=True, text=True).stderr.strip()
        version = version.splitlines()[0] if version else a.llama_bench
    else:
        if a.llamacpp_path:
            sys.path.insert(0, a.llamacpp_path)
        try:
            import llama_cpp  # noqa: PLC0415
        except ImportError:
            sys.exit("llama-cpp-python is not installed: pip install llama-cpp-python (or --llamacpp-path DIR, "
                     "or --llama-bench PATH)")
        version = llama_cpp.__version__
    print(f"model {model}, -ctk/-ctv {a.ctk}, {a.r} repetitions, llama.cpp {version}", flush=True)
    print("| threads | test | hybrid t/s | llama.cpp t/s | hybrid / llama.cpp |")
    print("|---|---|---|---|---|")
    for t in (int(x) for x in a.t.split(",")):
        for kind, n_p, n_g in (("pp", a.p, 0), ("tg", 0, a.n)):
            if not (n_p or n_g):
                continue
            if a.llama_bench:
                theirs = llama_bench_runs(a.llama_bench, model, n_p, n_g, t, a.r, a.ctk)[kind]
            else:
                theirs = llamacpp_isolated(a.llamacpp_path, model, n_p, n_g, t, a.r, a.ctk)[kind]
            mine = ours(model, n_p, n_g, t, a.r, a.ctk)[kind]
            ratio = statistics.mean(mine) / statistics.mean(theirs) if mine and theirs else float("nan")
            print(f"| {t} | {kind}{n_p or n_g} | {fmt(mine)} | {fmt(theirs)} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
