"""Tensor overrides, llama.cpp's `-ot/--override-tensor REGEX=DEVICE`, `-cmoe/--cpu-moe` and `-ncmoe/--n-cpu-moe N`:
an ordered list of (pattern, device) tried against each tensor name with a regex *search*; the first match wins,
and a tensor no override matches goes where its layer goes (-ngl).

llama.cpp pushes the overrides in command-line order; here the order is: every `-ot` entry as given, then
`--cpu-moe`, then `--n-cpu-moe`'s one override per block 0..N-1 (so an explicit `-ot` always wins over the two
shortcuts, as it does in llama.cpp when it comes first on the command line). Devices are llama.cpp's buffer type
names: `CPU`, and `CUDA0` for the (one) GPU. Pure functions: no hardware, no printing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hybrid.errors import HybridError

FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's LLM_FFN_EXPS_REGEX
CPU_DEVICE, GPU_DEVICE = "CPU", "CUDA0"
DEVICES = (CPU_DEVICE, GPU_DEVICE)


class InvalidOverride(HybridError, ValueError):
    """An -ot entry that is not REGEX=DEVICE, an invalid regex, or a device hybrid does not have."""


@dataclass(frozen=True)
class Override:
    pattern: str  # a regex searched in the tensor name (std::regex_search in llama.cpp)
    device: str  # "CPU" or "CUDA0"
    explicit: bool = field(default=True, compare=False)  # from -ot (False: --cpu-moe / --n-cpu-moe made it)

    def __str__(self) -> str:
        return f"{self.pattern}={self.device}"


def parse_override_tensor(values: Iterable[str]) -> tuple[Override, ...]:
    """The -ot values (each `REGEX=DEVICE[,REGEX=DEVICE...]`, repeatable) in order; InvalidOverride on a bad one."""
    out: list[Override] = []
    for value in values:
        for item in str(value).split(","):
            pattern, eq, device = item.partition("=")
            if not eq or not pattern:
                raise InvalidOverride(f"-ot '{item}': expected REGEX=DEVICE (e.g. 'ffn_.*_exps=CPU')")
            if device not in DEVICES:
                raise InvalidOverride(f"-ot '{item}': unknown device '{device}'; available: {', '.join(DEVICES)}")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise InvalidOverride(f"-ot '{item}': invalid regex ({exc})") from None
            out.append(Override(pattern, device))
    return tuple(out)


def cpu_moe_overrides(cpu_moe: bool = False, n_cpu_moe: int = 0) -> tuple[Override, ...]:
    """--cpu-moe: every layer's routed experts on the CPU; --n-cpu-moe N: those of blocks 0..N-1 (llama.cpp's
    llm_ffn_exps_cpu_override and llm_add_n_cpu_ffn_overrides)."""
    if n_cpu_moe < 0:
        raise InvalidOverride(f"--n-cpu-moe {n_cpu_moe}: give 0 or more layers")
    out = [Override(FFN_EXPS_REGEX, CPU_DEVICE, explicit=False)] if cpu_moe else []
    out += [Override(rf"blk\.{i}{FFN_EXPS_REGEX}", CPU_DEVICE, explicit=False) for i in range(n_cpu_moe)]
    return tuple(out)


def build_overrides(override_tensor: Sequence[str] = (), cpu_moe: bool = False,
                    n_cpu_moe: int = 0) -> tuple[Override, ...]:
    """The ordered overrides of a command line: -ot entries, then --cpu-moe, then --n-cpu-moe."""
    return parse_override_tensor(override_tensor) + cpu_moe_overrides(cpu_moe, n_cpu_moe)


def resolve(name: str, overrides: Sequence[Override]) -> str | None:
    """The device the first matching override gives tensor `name`, or None (it follows its layer)."""
    for o in overrides:
        if re.search(o.pattern, name):
            return o.device
    return None


def resolve_all(names: Iterable[str], overrides: Sequence[Override]) -> dict[str, str]:
    """{tensor name: device} for the names some override matches (the others follow their layer)."""
    compiled = [(re.compile(o.pattern), o.device) for o in overrides]
    out: dict[str, str] = {}
    for name in names:
        for rx, device in compiled:
            if rx.search(name):
                out[name] = device
                break
    return out


def unused(names: Iterable[str], overrides: Sequence[Override]) -> tuple[Override, ...]:
    """The -ot overrides whose regex matches no tensor name (llama.cpp says nothing; we warn). --n-cpu-moe's own
    are left out: --n-cpu-moe 99 on a 48-layer model is how "every layer" is said."""
    names = list(names)
    return tuple(o for o in overrides if o.explicit and not any(re.search(o.pattern, n) for n in names))


def unused_warnings(names: Iterable[str], overrides: Sequence[Override]) -> list[str]:
    """One warning line per -ot override that matches no tensor name (see `unused`)."""
    return [f"warning: override '{o}' matches no tensor of this model" for o in unused(names, overrides)]


def describe(overrides: Sequence[Override]) -> str:
    """llama-bench's tensor_buft_overrides field: "none" or "pattern=DEVICE;pattern=DEVICE"."""
    return ";".join(map(str, overrides)) or "none"
