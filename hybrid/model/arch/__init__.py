"""The architecture table, keyed by `general.architecture`, and the check that a model's layers hold what their
architecture needs."""

from gguf_io import ModelConfig
from gguf_io.errors import GGUFFormatError, UnsupportedArchitecture

from hybrid.model.arch import deepseek2
from hybrid.model.arch import gemma3
from hybrid.model.arch import glm4moe
from hybrid.model.arch import gpt_oss
from hybrid.model.arch import llama
from hybrid.model.arch import qwen2
from hybrid.model.arch import qwen3
from hybrid.model.arch import qwen3moe
from hybrid.model.arch.spec import ArchSpec, layer_tensors

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": llama.SPEC,
    "qwen2": qwen2.SPEC,
    "qwen3": qwen3.SPEC,
    "qwen3moe": qwen3moe.SPEC,
    "gemma3": gemma3.SPEC,
    "glm4moe": glm4moe.SPEC,
    "deepseek2": deepseek2.SPEC,
    "gpt-oss": gpt_oss.SPEC,
}


def arch_spec(name: str) -> ArchSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture '{name}' is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def adopt_layers(spec: ArchSpec, cfg: ModelConfig, weights) -> None:
    """In place on ModelWeights: the spec's aliases renamed to our names, then every layer checked for the tensors
    its architecture needs (GGUFFormatError naming the missing ones)."""
    for il, lw in enumerate(weights.layers):
        for theirs, ours in spec.aliases:
            for suffix in ("", ".bias"):
                if theirs + suffix in lw and ours + suffix not in lw:
                    lw[ours + suffix] = lw.pop(theirs + suffix)
        missing = [t for t in layer_tensors(spec, cfg, il) if t not in lw]
        if missing:
            raise GGUFFormatError(
                f"layer {il} lacks {', '.join(f'blk.{il}.{_file_name(m)}' for m in missing)} needed by {cfg.arch}"
            )


def _file_name(ours: str) -> str:
    """A layer tensor's name in the file: `attn_q` -> `attn_q.weight`, `attn_q.bias` as it is."""
    return ours if ours.endswith(".bias") else f"{ours}.weight"
