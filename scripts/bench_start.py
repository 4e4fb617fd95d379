"""Cold and warm start of `hybrid run -p hi -n 1`, and the peak RSS of `hybrid run -c 2048 -n 128`, as subprocesses.

Cold start runs in a copy of the repository (no .git) whose Numba caches (*.nbi, *.nbc) are moved aside first and
restored afterwards, so other people's caches in this checkout are never touched; the first-run marker lives in a
temporary HYBRID_CACHE_DIR. Warm start then runs in the same copy with its caches filled.

    python scripts/bench_start.py [--model PATH] [--cold 1] [--warm 5] [-t 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_measured(cmd: list[str], cwd: Path, env: dict) -> tuple[float, int, str, str, int]:
    """Run to completion; wall seconds, peak RSS bytes (ru_maxrss of this child alone), stdout, stderr, rc."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return wall, usage.ru_maxrss * 1024, out.read(), err.read(), p.returncode


def copy_repo(dst: Path) -> None:
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", ".pytest_cache", "*.nbi", "*.nbc"),
                    symlinks=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF model (default: the demo model)")
    ap.add_argument("--cold", type=int, default=1, help="cold-start repetitions (each recompiles: ~a minute)")
    ap.add_argument("--warm", type=int, default=5, help="warm-start repetitions")
    ap.add_argument("-t", "--threads", default="0")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from hybrid.model.files import resolve_model  # noqa: PLC0415 - after the path is set

    model = str(resolve_model(args.model))
    work = Path(tempfile.mkdtemp(prefix="hybrid-start-"))
    copy = work / "coldcopy"
    copy_repo(copy)  # without any Numba cache: the first run compiles everything
    env = {**os.environ, "PYTHONPATH": str(copy), "HYBRID_CACHE_DIR": str(work / "cache")}
    base = [sys.executable, "-m", "hybrid", "run", model, "-t", args.threads, "--temp", "0", "--no-display-prompt"]
    start = base + ["-p", "hi", "-n", "1"]
    rows = []
    try:
        colds = []
        for i in range(args.cold):
            if i:  # wipe the copy's caches again (each cold run recompiles)
                for f in [*copy.rglob("*.nbi"), *copy.rglob("*.nbc")]:
                    f.unlink()
            wall, rss, _, err, rc = run_measured(start, copy, env)
            if rc != 0:
                print(err, file=sys.stderr)
                return rc
            colds.append(wall)
            if "compiling kernels (first run only)" not in err:
                print("note: the cold run did not print the first-run compile message", file=sys.stderr)
        warms = []
        for _ in range(args.warm):
            wall, rss, _, err, rc = run_measured(start, copy, env)
            if rc != 0:
                print(err, file=sys.stderr)
                return rc
            warms.append(wall)
            if "compiling kernels" in err:
                print("note: a warm run printed the compile message", file=sys.stderr)
        wall, rss, out, err, rc = run_measured(base + ["-c", "2048", "-n", "128", "--json", "-p",
                                                       "Write a long story about a lighthouse keeper."], copy, env)
        if rc != 0:
            print(err, file=sys.stderr)
            return rc
        n_gen = len(json.loads(out.strip().splitlines()[-1])["generated_ids"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    rows.append(("cold start, `run -p hi -n 1` (no Numba cache)", f"{med(colds):.2f} s", f"median of {len(colds)}"))
    rows.append(("warm start, `run -p hi -n 1`", f"{med(warms):.2f} s",
                 f"median of {len(warms)} (min {min(warms):.2f}, max {max(warms):.2f})"))
    rows.append(("peak RSS, `run -c 2048 -n 128`", f"{rss / 2**20:.0f} MiB", f"{n_gen} tokens generated"))
    print(f"model: {model}\n")
    print("| measurement | value | notes |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
