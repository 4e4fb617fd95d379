"""`hybrid bench --batched`: llama-batched-bench's figures (BatchedRow) and its table, end to end on a fixture."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hybrid.tools.bench_batched import HEADER, BatchedRow

ROOT = Path(__file__).resolve().parents[1]


def test_batched_row_figures_follow_llama_batched_bench():
    r = BatchedRow(pp=128, tg=32, b=4, t_pp=2.0, t_tg=4.0)
    assert r.n_kv == 4 * (128 + 32)
    assert (r.s_pp, r.s_tg, r.t, r.s) == (256.0, 32.0, 6.0, 640 / 6.0)


def test_bench_batched_prints_the_table(fixtures_dir):
    model = fixtures_dir / "arch" / "llama-q4_k_m.gguf"
    r = subprocess.run([sys.executable, "-m", "hybrid", "bench", str(model), "--batched", "-npp", "8", "-ntg", "3",
                        "-npl", "1,2", "-t", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(HEADER)
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [row[:4] for row in rows] == [["8", "3", "1", "11"], ["8", "3", "2", "22"]]
    assert all(float(row[7]) > 0 for row in rows)  # S_TG
