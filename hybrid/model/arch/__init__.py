"""The architecture table, keyed by `general.architecture`."""

from gguf_io.errors import UnsupportedArchitecture

from hybrid.model.arch import gemma3
from hybrid.model.arch import llama
from hybrid.model.arch import qwen2
from hybrid.model.arch import qwen3
from hybrid.model.arch import qwen3moe
from hybrid.model.arch.spec import ArchSpec

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": llama.SPEC,
    "qwen2": qwen2.SPEC,
    "qwen3": qwen3.SPEC,
    "qwen3moe": qwen3moe.SPEC,
    "gemma3": gemma3.SPEC,
}


def arch_spec(name: str) -> ArchSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture '{name}' is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
