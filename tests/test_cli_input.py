"""What a new user types, driven through the real command (a subprocess, as tests/test_cli.py): prompts longer than
the context, llama.cpp's flags and their ranges, control tokens, files that are not UTF-8, Ctrl-C, and the rough
edges of info/probe/--help. No `internal error:` may reach a user for input they typed."""

from __future__ import annotations

import inspect
import json
import os
import re
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gguf_factory import tiny_model, write_gguf

ROOT = Path(__file__).resolve().parents[1]


def hybrid(*args: str | bytes, input: str | None = None, env: dict | None = None, timeout: int = 600,
           **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid", *args], cwd=ROOT, capture_output=True, text=True,
                          input=input, timeout=timeout, env={**os.environ, **(env or {})}, **kw)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def usage_error(r: subprocess.CompletedProcess, flag: str) -> None:
    """Exit 2, typer's usage error naming the flag with its message on one line, nothing loaded or generated."""
    assert r.returncode == 2, r.stderr
    msg = [line for line in r.stderr.splitlines() if "Invalid value" in line]
    assert len(msg) == 1 and flag in msg[0], r.stderr  # the message fits one line of typer's 80-column box
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr
    assert "load time" not in r.stderr and r.stdout == ""


@pytest.fixture(scope="module")
def llama(fixtures_dir) -> str:
    return str(fixtures_dir / "arch" / "llama-q4_k_m.gguf")  # trained context 4096


@pytest.fixture(scope="module")
def qwen2(fixtures_dir) -> str:
    return str(fixtures_dir / "arch" / "qwen2-q4_k_m.gguf")


# -- 1. a prompt longer than the context: refused once, before any work, with the real numbers ----------------------
def test_long_prompt_refused_before_echo_with_real_count(llama, tmp_path):
    text = "The quick brown fox jumps over the lazy dog. " * 60
    f = tmp_path / "long.txt"
    f.write_text(text)
    n = len(json.loads(hybrid("tokenize", llama, "-p", text, "--json").stdout)["ids"])
    assert n > 256
    r = hybrid("run", llama, "-f", str(f), "-c", "256", "-n", "4")
    assert r.returncode == 1
    assert r.stdout == ""  # the prompt is not echoed
    err = lines(r.stderr)
    assert len(err) == 1 and err[0].startswith("error: context:"), r.stderr
    assert f"the prompt is {n} tokens" in err[0] and "context of 256" in err[0]
    assert "prompt eval time" not in r.stderr  # nothing was computed


def test_generate_checks_once_before_any_eval(llama):
    from hybrid.engine.engine import Engine
    from hybrid.engine.params import EngineParams
    from hybrid.errors import ContextTooLarge
    from hybrid.generate.loop import generate
    from hybrid.generate.sampling import SamplingParams

    engine = Engine.load(llama, EngineParams(n_ctx=64, n_batch=16, n_ubatch=16))
    try:
        calls = []
        engine.eval = lambda tokens, cache, logits_from=None: calls.append(len(tokens))  # type: ignore[method-assign]
        cache = engine.new_cache()
        with pytest.raises(ContextTooLarge, match=r"the prompt is 100 tokens, more than the context of 64"):
            next(generate(engine, [5] * 100, SamplingParams(temp=0), 4, cache))
        cache.n_past = 50
        with pytest.raises(ContextTooLarge, match=r"50 tokens in the cache and a prompt of 20 make 70, more than "
                                                  r"the context of 64"):
            next(generate(engine, [5] * 20, SamplingParams(temp=0), 4, cache))
        assert calls == []  # refused before the first batch, not inside Engine.eval
    finally:
        engine.close()


def test_chat_turn_too_long_is_one_line_and_the_chat_goes_on(qwen2):
    long_turn = "word " * 200
    r = hybrid("chat", qwen2, "-c", "128", "-n", "4", "--temp", "0", input=f"Hi\n{long_turn}\nAgain\n")
    assert r.returncode == 0, r.stderr
    refused = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(refused) == 1 and "context" in refused[0] and "128" in refused[0] and "goes on" in refused[0]
    turns = [line for line in r.stderr.splitlines() if "reused from the cache" in line]
    assert len(turns) == 2  # the turns before and after the refused one
    assert "(0 reused" not in turns[1]  # the refused turn left the cache and the conversation as they were


# -- 5. rich markup: user-facing strings keep their brackets -------------------------------------------------------
def test_info_keeps_brackets(tmp_path):
    md, ts = tiny_model("llama", extra={"general.name": "tiny [cuda13] [bold]x[/bold]"})
    path = write_gguf(tmp_path / "br[a]ckets.gguf", md, ts)
    r = hybrid("info", str(path))
    assert r.returncode == 0, r.stderr
    assert "tiny [cuda13] [bold]x[/bold]" in r.stdout
    assert f"file {path}:" in r.stdout
    if "CuPy is not installed" in r.stdout:  # the GPU install hint, as the library wrote it
        assert "hybrid[cuda13]" in r.stdout.replace("\n", " ").replace("│", "")


# -- 6. llama.cpp's flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["info", "tokenize", "probe", "perplexity", "run", "bench"])
def test_model_flag_on_every_command(cmd, llama, fixtures_dir):
    extra = {
        "info": ["--json"],
        "tokenize": ["-p", "Hello", "--json"],
        "probe": ["--dry-run", "--vram-budget", "1GiB", "--json"],
        "perplexity": ["-f", str(fixtures_dir / "gemma-3-270m" / "gpl3.txt"), "-c", "128", "--chunks", "1", "--json"],
        "run": ["-p", "Hello", "-n", "3", "--temp", "0", "--json"],
        "bench": ["-p", "8", "-n", "2", "-r", "1", "-o", "json"],
    }[cmd]
    by_option = hybrid(cmd, "-m", llama, *extra)
    assert by_option.returncode == 0, by_option.stderr
    by_position = hybrid(cmd, llama, *extra)
    assert by_position.returncode == 0, by_position.stderr
    if cmd in ("tokenize", "run"):
        a, b = json.loads(by_option.stdout), json.loads(by_position.stdout)
        key = "ids" if cmd == "tokenize" else "generated_ids"
        assert a[key] == b[key]
    same = hybrid(cmd, llama, "-m", f"./{Path(llama).relative_to(ROOT)}", *extra)  # one file, two spellings
    assert same.returncode == 0, same.stderr
    usage_error(hybrid(cmd, llama, "-m", "/other/model.gguf", *extra), "model")


@pytest.mark.parametrize("args,flag", [
    (["-c", "-5"], "--ctx-size"),
    (["-n", "-2"], "--n-predict"),
    (["-t", "-3"], "--threads"),
    (["-t", str((os.cpu_count() or 1) + 1)], "--threads"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["-b", "0"], "--batch-size"),
    (["-ub", "0"], "--ubatch-size"),
    (["--repeat-penalty", "0"], "--repeat-penalty"),
    (["--temp", "nan"], "--temp"),
])
def test_out_of_range_flags_are_usage_errors(llama, args, flag):
    usage_error(hybrid("run", llama, "-p", "Hello", *args), flag)


def test_range_checks_are_shared(llama, fixtures_dir):
    usage_error(hybrid("probe", llama, "--dry-run", "--vram-budget", "1GiB", "-c", "-1"), "--ctx-size")
    usage_error(hybrid("perplexity", llama, "-f", str(fixtures_dir / "gemma-3-270m" / "gpl3.txt"), "-t", "-2"),
                "--threads")
    usage_error(hybrid("chat", llama, "-b", "-1"), "--batch-size")
    usage_error(hybrid("bench", llama, "-t", "-2"), "-t")
    usage_error(hybrid("bench", llama, "-ub", "512,0"), "-ub")


def test_threads_auto_and_in_range_run(llama):
    for t in ("-1", "0", "1", str(os.cpu_count() or 1)):
        r = hybrid("run", llama, "-p", "Hello", "-n", "2", "-t", t)
        assert r.returncode == 0, (t, r.stderr)


def test_ctx_above_training_context_warns_once(llama):
    r = hybrid("run", llama, "-p", "Hello", "-n", "2", "-c", "8192")
    assert r.returncode == 0, r.stderr
    warn = [line for line in r.stderr.splitlines() if "training context" in line]
    assert warn == ["warning: -c 8192 is larger than the model's training context 4096"]
    r = hybrid("run", llama, "-p", "Hello", "-n", "2", "-c", "4096")
    assert "training context" not in r.stderr


def test_negative_temp_is_greedy(llama):
    a = json.loads(hybrid("run", llama, "-p", "Hello world", "-n", "6", "--temp", "0", "--json").stdout)
    b = json.loads(hybrid("run", llama, "-p", "Hello world", "-n", "6", "--temp", "-1", "--json").stdout)
    assert a["generated_ids"] == b["generated_ids"] and len(a["generated_ids"]) == 6


def test_control_tokens_print_only_with_special(tmp_path):
    # a tiny model whose every token but <unk> is a control token: what it generates prints as nothing
    md, ts = tiny_model("llama", n_vocab=40)
    md["tokenizer.ggml.tokens"] = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, 40)]
    md["tokenizer.ggml.token_type"] = np.array([2] + [3] * 39, dtype=np.int32)
    model = str(write_gguf(tmp_path / "control.gguf", md, ts))
    common = ["-p", "<s>", "-n", "6", "--temp", "0", "-c", "256"]
    d = json.loads(hybrid("run", model, *common, "--json").stdout)
    gen = d["generated_ids"]
    assert gen and d["text"] == ""
    plain = hybrid("run", model, *common, "--no-display-prompt")
    assert plain.returncode == 0 and plain.stdout == "\n", plain.stderr
    special = hybrid("run", model, *common, "--no-display-prompt", "--special")
    assert special.stdout == "".join(f"\u2581t{i}" for i in gen) + "\n"
    d = json.loads(hybrid("run", model, *common, "--json", "-sp").stdout)
    assert d["text"] == "".join(f"\u2581t{i}" for i in gen)


def test_timings_end_with_total_time(llama):
    r = hybrid("run", llama, "-p", "Hello", "-n", "4", "--temp", "0")
    assert r.returncode == 0, r.stderr
    last = lines(r.stderr)[-1]
    m = re.fullmatch(r"\s*total time =\s+([\d.]+) ms /\s+(\d+) tokens", last)
    assert m, r.stderr
    prompt_n = int(re.search(r"prompt eval time =.*/\s+(\d+) tokens", r.stderr).group(1))
    eval_n = int(re.search(r"\beval time =.*/\s+(\d+) runs", r.stderr.split("prompt eval time")[1]).group(1))
    assert int(m.group(2)) == prompt_n + eval_n
    d = json.loads(hybrid("run", llama, "-p", "Hello", "-n", "4", "--json").stdout)
    assert d["timings"]["total_ms"] >= d["timings"]["prompt_ms"] + d["timings"]["predicted_ms"]


# -- 7. files that are not UTF-8, and no internal error for input a user typed -----------------------------------
def test_non_utf8_file_read_alike_by_run_and_perplexity(llama, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes(("caf\u00e9 " * 3).encode("latin-1") + b"The quick brown fox jumps over the lazy dog. " * 20)
    run = hybrid("run", llama, "-f", str(f), "-n", "2", "--temp", "0")
    ppl = hybrid("perplexity", llama, "-f", str(f), "-c", "64", "--chunks", "1")
    assert run.returncode == 0, run.stderr
    assert ppl.returncode == 0, ppl.stderr
    warning = f"warning: {f} is not valid UTF-8 (byte 0xe9 at offset 3); such bytes are read as U+FFFD"
    assert lines(run.stderr)[0] == warning and lines(ppl.stderr)[0] == warning
    assert run.stdout.startswith("caf\ufffd caf\ufffd")


@pytest.mark.parametrize("args", [
    ["run", "{m}", "-p", b"caf\xe9", "-n", "2"],  # bytes in argv that are not UTF-8
    ["tokenize", "{m}", "-p", b"caf\xe9"],
    ["run", "{m}", "-p", "x", "-c", "-5"],
    ["run", "{m}", "-p", "x", "-b", "0"],
    ["run", "{m}", "-p", "x", "-ub", "0"],
    ["run", "{m}", "-p", "x", "--repeat-penalty", "0", "--temp", "1"],
    ["run", "{m}", "-p", "x", "--presence-penalty", "-inf"],
    ["run", "{m}", "-p", "x", "-n", "2", "-f", "/nonexistent.txt"],
    ["run", "{m}", "-f", "/"],
    ["run", "{m}", "-p", "x", "-ngl", "lots"],
    ["run", "{m}", "-p", "x", "--vram-budget", "12XB"],
    ["run", "{m}", "-p", "x", "-C", "zz"],
    ["run", "{m}", "-p", "x", "-ctk", "q9"],
    ["chat", "{m}", "--chat-template", "{bad_template}", "-n", "2"],
    ["chat", "{m}", "--chat-template", "nosuch", "-n", "2"],
    ["perplexity", "{m}", "-f", "{short}"],
    ["perplexity", "{m}", "-f", "{short}", "-c", "2"],
    ["bench", "{m}", "-pg", "4,-1"],
    ["bench", "{m}", "-r", "0"],
    ["bench", "{m}", "-ngl", "auto"],
    ["probe", "{m}", "--dry-run", "--vram-budget", "1GiB", "--margin", "lots"],
    ["probe", "{m}", "--dry-run", "--vram-budget", "-1GiB"],
    ["info", "/nonexistent.gguf"],
])
def test_no_internal_error_for_typed_input(args, llama, tmp_path):
    bad_template = tmp_path / "t.jinja"
    bad_template.write_bytes(b"\xff{{ messages }}")
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    subs = {"{m}": llama, "{bad_template}": str(bad_template), "{short}": str(short)}
    argv = [os.fsencode(a) if isinstance(a, bytes) else subs.get(a, a) for a in args]
    r = subprocess.run([sys.executable, "-m", "hybrid", *argv], cwd=ROOT, capture_output=True, input=b"hi\n",
                       timeout=600)
    err = r.stderr.decode("utf-8", "replace")
    assert "internal error" not in err and "Traceback" not in err, err
    if r.returncode == 1:
        assert lines(err)[-1].startswith("error: "), err
    else:
        assert r.returncode in (0, 2), err


def test_zero_context_means_the_training_context_in_perplexity(llama, fixtures_dir):
    r = hybrid("perplexity", llama, "-f", str(fixtures_dir / "gemma-3-270m" / "gpl3.txt"), "-c", "0",
               "--chunks", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_ctx"] == 4096


# -- 8. Ctrl-C ---------------------------------------------------------------------------------------------------
def _read_until(proc: subprocess.Popen, buf: bytes, done, timeout: float) -> bytes:
    end = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    while not done(buf) and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    assert done(buf), f"timed out; stdout so far: {buf!r}"
    return buf


def test_ctrl_c_during_run_prints_partial_timings_and_exits_130(llama):
    p = subprocess.Popen([sys.executable, "-m", "hybrid", "run", llama, "-p", "Once", "-n", "-1", "-c", "16384"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _read_until(p, b"", lambda b: len(b) > len("Once") + 10, 300)  # generated text is streaming
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    err = err.decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted" not in err
    runs = int(re.search(r"\beval time =.*/\s+(\d+) runs", err.split("prompt eval time")[1]).group(1))
    assert 0 < runs < 16000  # stopped long before the context was full
    assert lines(err)[-1].lstrip().startswith("total time =")


def test_ctrl_c_during_chat_reply_returns_to_the_prompt(qwen2):
    p = subprocess.Popen([sys.executable, "-m", "hybrid", "chat", qwen2, "-n", "-1", "-c", "16384", "--temp", "0"],
                         cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        buf = _read_until(p, b"", lambda b: b.count(b"> ") >= 1, 300)
        p.stdin.write(b"Hello\n")
        p.stdin.flush()
        buf = _read_until(p, buf, lambda b: len(b.split(b"> ", 1)[1]) > 20, 120)  # the reply is streaming
        p.send_signal(signal.SIGINT)
        buf = _read_until(p, buf, lambda b: b.count(b"> ") >= 2, 60)  # back at the prompt
        p.stdin.write(b"Again\n")  # the chat goes on, with the stopped reply in its history
        p.stdin.flush()
        buf = _read_until(p, buf, lambda b: len(b.rsplit(b"> ", 1)[1]) > 20, 120)
        p.send_signal(signal.SIGINT)  # stops the second reply
        buf = _read_until(p, buf, lambda b: b.count(b"> ") >= 3, 60)
        p.send_signal(signal.SIGINT)  # Ctrl-C at the prompt ends the chat
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    err = err.decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "error" not in err
    stopped = [line for line in err.splitlines() if "reply stopped" in line]
    assert len(stopped) == 2 and "(0 reused" not in stopped[1], err


def test_ctrl_d_ends_the_chat(qwen2):
    r = hybrid("chat", qwen2, "-n", "2", "--temp", "0", input="Hello\n")  # then end of input
    assert r.returncode == 0, r.stderr


# -- 9. probe, --help, the cache directory ------------------------------------------------------------------------
def test_probe_without_gpu_says_it_once(llama):
    r = hybrid("probe", llama)
    if r.returncode == 0:
        pytest.skip("a GPU is usable here")
    assert r.returncode == 1 and len(lines(r.stderr)) == 1
    assert r.stderr.count("no usable GPU") == 1, r.stderr


def test_probe_keeps_a_long_model_path_whole(llama, tmp_path):
    d = tmp_path / ("a-directory-with-a-rather-long-name-" * 2)
    d.mkdir()
    path = d / "a-model-file-with-a-long-name-too.gguf"
    path.symlink_to(llama)
    assert len(str(path)) > 100
    r = hybrid("probe", str(path), "--dry-run", "--vram-budget", "1GiB", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert f"hybrid probe: {path}" in r.stdout.splitlines()
    assert any(line.startswith(f"hybrid run {path} -ngl ") for line in r.stdout.splitlines())


def test_probe_mlock_row_in_binary_units(llama):
    def low_memlock() -> None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))

    r = hybrid("probe", llama, "--dry-run", "--vram-budget", "1MiB", "--json", preexec_fn=low_memlock)
    assert r.returncode == 0, r.stderr
    mlock = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "mlock")
    assert "64.0 KiB" in mlock["detail"] and not re.search(r"\d{4,} B\b", mlock["detail"]), mlock


def test_help_paragraphs_are_not_broken_mid_sentence():
    from hybrid.cli import bench, info, perplexity, probe, run, tokenize

    for name, fn in [("run", run.run), ("chat", run.chat), ("perplexity", perplexity.perplexity),
                     ("bench", bench.bench), ("probe", probe.probe), ("info", info.info),
                     ("tokenize", tokenize.tokenize)]:
        r = hybrid(name, "--help", env={"COLUMNS": "400"})
        assert r.returncode == 0, r.stderr
        shown = [line.strip() for line in r.stdout.splitlines()]
        for paragraph in inspect.cleandoc(fn.__doc__).split("\n\n"):
            assert " ".join(paragraph.split()) in shown, (name, paragraph)


def test_cache_directory_error_is_not_model_not_found(tmp_path):
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("")
    r = hybrid("info", env={"HYBRID_CACHE_DIR": str(not_a_dir)})
    if "not installed" in r.stderr:
        pytest.skip("the demo model's packages are not installed here")
    assert r.returncode == 1
    err = lines(r.stderr)[-1]
    assert err.startswith("error: cache directory: ") and "HYBRID_CACHE_DIR" in err, r.stderr
    assert "model not found" not in r.stderr


def test_one_line_labels_cache_directory_failures(tmp_path):
    from hybrid.cli.errors import one_line
    from hybrid.errors import ModelNotFound

    try:
        try:
            open(tmp_path / "missing" / "x.gguf", "wb")
        except OSError as exc:
            raise ModelNotFound(f"could not write the model into {tmp_path}: {exc}") from None
    except ModelNotFound as exc:
        assert one_line(exc).startswith("error: cache directory: could not write")
    assert one_line(ModelNotFound("model file not found: /x.gguf")).startswith("error: model not found: ")
