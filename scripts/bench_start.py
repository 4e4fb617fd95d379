"""A first run from a fresh HOME, warm starts, and the peak RSS of `hybrid run -c 2048 -n 128`, as subprocesses.

A first run is `hybrid run -p "The capital of France is" -n 32` with HOME a new empty folder (so the demo model is
assembled from its installed packages into it) in a copy of the repository (no .git) without any Numba cache
(*.nbi, *.nbc): the kernels compile, so other people's caches in this checkout are never touched. The warm starts
then run in the same copy and HOME, caches filled: `run -p hi -n 1`, and the first run's command again.

    python scripts/bench_start.py [--model PATH] [--cold 1] [--warm 5] [-t 0] [--show-first]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST = ["-p", "The capital of France is", "-n", "32"]


def run_measured(cmd: list[str], cwd: Path, env: dict) -> tuple[float, int, str, list[tuple[float, str]], int]:
    """Run to completion; wall seconds, peak RSS bytes (ru_maxrss of this child alone), stdout, stderr lines with
    the second each came, rc."""
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.PIPE, text=True)
        lines = [(time.perf_counter() - t0, line.rstrip("\n")) for line in p.stderr]
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        return wall, usage.ru_maxrss * 1024, out.read(), lines, os.waitstatus_to_exitcode(status)


def copy_repo(dst: Path) -> None:
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", ".pytest_cache", "*.nbi", "*.nbc", "fixtures"),
                    symlinks=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the demo model, assembled into the fresh HOME)")
    ap.add_argument("--cold", type=int, default=1, help="first-run repetitions (each compiles the kernels again)")
    ap.add_argument("--warm", type=int, default=5, help="warm-start repetitions")
    ap.add_argument("-t", "--threads", default="0")
    ap.add_argument("--show-first", action="store_true", help="print each first run's stderr, lines timed")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hybrid-start-"))
    copy, home = work / "coldcopy", work / "home"
    copy_repo(copy)  # without any Numba cache: the first run compiles every kernel it needs
    env = {k: v for k, v in os.environ.items() if k not in ("HYBRID_CACHE_DIR", "NUMBA_CACHE_DIR")}
    env |= {"PYTHONPATH": str(copy), "HOME": str(home)}
    base = [sys.executable, "-m", "hybrid", "run", *([args.model] if args.model else []), "-t", args.threads,
            "--temp", "0", "--no-display-prompt"]

    def measured(cmd: list[str], expect_compile: bool) -> tuple[float, int, str]:
        wall, rss, out, lines, rc = run_measured(cmd, copy, env)
        err = "\n".join(line for _, line in lines)
        if rc != 0:
            sys.exit(f"{' '.join(cmd)} exited with {rc}:\n{err}")
        if ("compiling kernels" in err) != expect_compile:
            print(f"note: the compile message was {'missing' if expect_compile else 'printed'}:\n{err}",
                  file=sys.stderr)
        if expect_compile and args.show_first:
            print("\n".join(f"{t:6.2f} s  {line}" for t, line in lines) + f"\n{wall:6.2f} s  (exit)\n")
        return wall, rss, out

    try:
        firsts = []
        for _ in range(args.cold):
            for f in [*copy.rglob("*.nbi"), *copy.rglob("*.nbc")]:
                f.unlink()
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir()
            firsts.append(measured(base + FIRST, True)[0])
        starts = [measured(base + ["-p", "hi", "-n", "1"], False)[0] for _ in range(args.warm)]
        agains = [measured(base + FIRST, False)[0] for _ in range(args.warm)]
        _, rss, out = measured(base + ["-c", "2048", "-n", "128", "--json", "-p",
                                       "Write a long story about a lighthouse keeper."], False)
        n_gen = len(json.loads(out.strip().splitlines()[-1])["generated_ids"])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def spread(xs: list[float]) -> str:
        return f"median of {len(xs)}" + (f" (min {min(xs):.2f}, max {max(xs):.2f})" if len(xs) > 1 else "")

    med = statistics.median
    first = f"first run, `run {shlex.join(FIRST)}` (fresh HOME, no Numba cache)"
    rows = [(first, f"{med(firsts):.2f} s", spread(firsts)),
            ("warm start, `run -p hi -n 1`", f"{med(starts):.2f} s", spread(starts)),
            (f"warm, `run {shlex.join(FIRST)}`", f"{med(agains):.2f} s", spread(agains)),
            ("peak RSS, `run -c 2048 -n 128`", f"{rss / 2**20:.0f} MiB", f"{n_gen} tokens generated")]
    print(f"model: {args.model or 'the demo model'}\n")
    print("| measurement | value | notes |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
