"""The CLI end to end in a subprocess: help, info, tokenize, run, perplexity, bench, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def hybrid(*args: str, input: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid", *args], cwd=ROOT, capture_output=True, text=True,
                          input=input, timeout=timeout)


def test_help_lists_commands():
    r = hybrid("--help")
    assert r.returncode == 0
    for cmd in ("run", "chat", "perplexity", "bench", "info", "tokenize"):
        assert cmd in r.stdout


@pytest.mark.parametrize("args,expect", [
    (["info", "/nonexistent.gguf"], "model not found"),
    (["info", "/etc/hostname"], "invalid GGUF file"),
    (["run", "/etc/hostname", "-p", "x"], "invalid GGUF file"),
])
def test_bad_input_gives_one_line_error(args, expect):
    r = hybrid(*args)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expect in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_truncated_gguf_is_one_line(tmp_path, fixtures_dir):
    src = (fixtures_dir / "arch" / "llama-q4_k_m.gguf").read_bytes()
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(src[: len(src) // 2])
    r = hybrid("run", str(bad), "-p", "x", "-n", "1")
    assert r.returncode == 1 and "invalid GGUF file" in r.stderr and "Traceback" not in r.stderr


def test_unknown_architecture(fixtures_dir):
    r = hybrid("run", str(fixtures_dir / "vocab" / "ggml-vocab-gpt-2.gguf"), "-p", "x")
    assert r.returncode == 1 and "unsupported architecture" in r.stderr and "llama" in r.stderr


def test_usage_error_exit_2():
    r = hybrid("run", "--no-such-flag")
    assert r.returncode == 2 and "No such option" in r.stderr


def test_info_json(fixtures_dir):
    r = hybrid("info", str(fixtures_dir / "arch" / "qwen3-q4_k_m.gguf"), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"]["architecture"] == "qwen3"
    assert d["model"]["config"]["n_embd_head_k"] == 128
    assert {t["type_name"] for t in d["model"]["types"]} == {"F32", "Q4_K", "Q6_K"}
    assert d["machine"]["physical_cores"] >= 1


def test_tokenize_json_demo(demo_model):
    r = hybrid("tokenize", str(demo_model), "-p", "<start_of_turn>user\nHello", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["ids"][:2] == [2, 105]  # BOS, then <start_of_turn> parsed as a special token
    assert len(d["ids"]) == len(d["pieces"])


def test_run_json_greedy_is_deterministic(fixtures_dir):
    model = str(fixtures_dir / "arch" / "qwen2-q4_k_m.gguf")
    a = hybrid("run", model, "-p", "Hello world", "-n", "8", "--temp", "0", "--json", "-t", "1")
    assert a.returncode == 0, a.stderr
    d = json.loads(a.stdout)
    assert d["prompt_ids"][0] == 1 and len(d["generated_ids"]) == 8
    assert d["timings"]["predicted_n"] == 7 and d["timings"]["prompt_per_second"] > 0
    b = hybrid("run", model, "-p", "Hello world", "-n", "8", "--temp", "0.9", "--seed", "7", "--json")
    c = hybrid("run", model, "-p", "Hello world", "-n", "8", "--temp", "0.9", "--seed", "7", "--json")
    assert json.loads(b.stdout)["generated_ids"] == json.loads(c.stdout)["generated_ids"]


def test_run_prints_timings(fixtures_dir):
    r = hybrid("run", str(fixtures_dir / "arch" / "llama-q4_k_m.gguf"), "-p", "Once", "-n", "4")
    assert r.returncode == 0, r.stderr
    assert "prompt eval time" in r.stderr and "tokens per second" in r.stderr


def test_ngl_without_gpu_says_so_and_runs(fixtures_dir):
    r = hybrid("run", str(fixtures_dir / "arch" / "llama-q4_k_m.gguf"), "-p", "Once", "-n", "2", "-ngl", "99")
    if "no GPU is usable" not in r.stderr:
        pytest.skip("a GPU is usable here")
    assert r.returncode == 0


def test_explain_needs_no_gpu(fixtures_dir):
    model = str(fixtures_dir / "arch" / "llama-q4_k_m.gguf")
    r = hybrid("run", model, "--explain", "-ngl", "3", "--vram-budget", "1GiB", "-c", "256")
    assert r.returncode == 0, r.stderr
    assert "3/5 layers on the GPU" in r.stderr
    r = hybrid("run", model, "--explain", "-ngl", "5", "--vram-budget", "100MiB", "-c", "256")
    assert r.returncode == 1 and "does not fit" in r.stderr and "fit" in r.stderr


def test_context_too_large_is_one_line(fixtures_dir):
    r = hybrid("run", str(fixtures_dir / "arch" / "llama-q4_k_m.gguf"), "-p", "a b c d e f g h i j k l", "-c", "4")
    assert r.returncode == 1 and "context" in r.stderr


def test_perplexity_json(fixtures_dir):
    r = hybrid("perplexity", str(fixtures_dir / "arch" / "llama-f16.gguf"), "-f",
               str(fixtures_dir / "gemma-3-270m" / "gpl3.txt"), "-c", "128", "-b", "128", "--chunks", "4", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    # llama.cpp's running PPL after 4 chunks on this model (manifest: 16 chunks); check against the npz
    import numpy as np

    ref = np.load(fixtures_dir / "arch" / "llama-f16.GPL-3.npz")
    assert abs(d["ppl"] / float(ref["ppl_running"][3]) - 1) < 0.01


def test_bench_json_fields(fixtures_dir):
    r = hybrid("bench", "-m", str(fixtures_dir / "arch" / "llama-q4_k_m.gguf"), "-p", "16", "-n", "4", "-r", "2",
               "-t", "1", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["test"] for row in rows] == ["pp16", "tg4"]
    for row in rows:
        for key in ("model_type", "n_threads", "n_gpu_layers", "type_k", "n_prompt", "n_gen", "avg_ts",
                    "stddev_ts", "samples_ts"):
            assert key in row
        assert row["avg_ts"] > 0 and len(row["samples_ts"]) == 2


def test_bench_sweeps_no_repack(fixtures_dir):
    r = hybrid("bench", "-m", str(fixtures_dir / "arch" / "llama-q4_k_m.gguf"), "-p", "0", "-n", "4", "-r", "1",
               "-t", "1", "-nr", "0,1", "-o", "json")
    assert r.returncode == 0, r.stderr
    assert [row["no_repack"] for row in json.loads(r.stdout)] == [0, 1]
    r = hybrid("run", str(fixtures_dir / "arch" / "llama-q4_k_m.gguf"), "-p", "Once", "-n", "2", "--no-repack")
    assert r.returncode == 0, r.stderr


def test_chat_keeps_cache_between_turns(fixtures_dir):
    r = hybrid("chat", str(fixtures_dir / "arch" / "qwen2-q4_k_m.gguf"), "-n", "4", "--temp", "0",
               input="Hello\nAgain\n")
    assert r.returncode == 0, r.stderr
    turns = [line for line in r.stderr.splitlines() if "reused from the cache" in line]
    assert len(turns) == 2
    assert "(0 reused" in turns[0] and "(0 reused" not in turns[1]
