"""Every option shared by more than one command, declared once (llama.cpp's flag names), and `engine_flags`,
which gives a command the loading flags it names and hands it one EngineParams built from them.

A new loading flag: its Annotated declaration here (with its range check: a callback whose typer.BadParameter is a
usage error, exit 2, before anything loads), one entry in ENGINE_FLAGS, one field of EngineParams. The model is
MODEL or -m/--model (ModelArgument, ModelOpt), merged while the flags are parsed."""

from __future__ import annotations

import copy
import functools
import inspect
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from hybrid.engine.params import EngineParams
from hybrid.errors import HybridError
from hybrid.plan.moe_cache import DEFAULT_INSERTS, DEFAULT_POLICY, parse_moe_cache
from hybrid.plan.overrides import build_overrides
from hybrid.system.numa import check_mode as check_numa_mode
from hybrid.system.sizes import parse_size
from hybrid.system.threads import select_cpus

from hybrid.cli.common import ModelArg


# -- range checks: a bad value is a usage error (exit 2) before anything is loaded ------------------------------
# The messages are short: typer prints them after "Invalid value for '-t' / '--threads': " in an 80-column box.
def logical_cpus() -> int:
    return os.cpu_count() or 1


def check_threads(value: int, hint: str | None = None) -> int:
    """-t: 1 to the machine's logical CPUs, or -1 (llama.cpp's default) / 0 for one thread per physical core."""
    n = logical_cpus()
    if value < -1 or value > n:
        raise typer.BadParameter(f"{value}: give 1 to {n} (logical CPUs) or -1", param_hint=hint)
    return value


def check_batch(value: int, hint: str | None = None) -> int:
    if value <= 0:
        raise typer.BadParameter(f"{value} is below 1", param_hint=hint)
    return value


def _threads(value: int) -> int:
    return check_threads(value)


def at_least(low: int, meaning: str = "") -> Callable[[int], int]:
    """A callback refusing values below `low` (`meaning`: what `low` itself means, said in the message)."""

    def check(value: int | None) -> int | None:
        if value is not None and value < low:  # None: a command's "auto" default
            raise typer.BadParameter(f"{value} is below {low}" + (f" ({low} = {meaning})" if meaning else ""))
        return value

    return check


def _top_p(value: float) -> float:
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise typer.BadParameter(f"{value} is not in (0, 1] (1.0 = off)")
    return value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value}: give a finite number")
    return value


def _repeat_penalty(value: float) -> float:
    if not (math.isfinite(value) and value > 0.0):
        raise typer.BadParameter(f"{value}: give a value above 0 (1 = off)")
    return value


# -- the model: MODEL, or -m/--model as llama.cpp's tools take it --------------------------------------------------
# Merged while the flags are parsed (whichever of the two is parsed second merges), so `model` holds the model
# before the command, or anything wrapping it, runs; `model_opt` is then only a duplicate.
def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
    except OSError:
        return False


def _merge_models(positional: Optional[str], option: Optional[str]) -> Optional[str]:
    if positional is not None and option is not None and not _same_model(positional, option):
        raise typer.BadParameter(f"'{positional}' and -m '{option}' differ: give one model")
    return positional if positional is not None else option


def _model_positional(ctx: typer.Context, value: Optional[str]) -> Optional[str]:
    return value if ctx.resilient_parsing else _merge_models(value, ctx.params.get("model_opt"))


def _model_option(ctx: typer.Context, value: Optional[str]) -> Optional[str]:
    if not ctx.resilient_parsing:
        _merge_models(ctx.params.get("model"), value)
    return value


def _with_callback(declaration: Any, callback: Callable) -> Any:
    """An Annotated typer declaration with a callback added (its help and the rest as declared)."""
    info = copy.copy(declaration.__metadata__[0])
    info.callback = callback
    return Annotated[declaration.__origin__, info]


ModelArgument = _with_callback(ModelArg, _model_positional)  # MODEL, as common.ModelArg declares it
ModelOpt = Annotated[
    Optional[str],
    typer.Option("-m", "--model", callback=_model_option, show_default=False,
                 help="The model, as llama.cpp's -m: the same as MODEL (give one of the two)."),
]


CtxOpt = Annotated[
    int,
    typer.Option("-c", "--ctx-size", callback=at_least(0, "as trained"),
                 help="Context size in tokens (0 = the model's training context)."),
]
BatchOpt = Annotated[
    int, typer.Option("-b", "--batch-size", callback=at_least(1), help="Logical batch: prompt tokens per eval call.")
]
UBatchOpt = Annotated[
    int, typer.Option("-ub", "--ubatch-size", callback=at_least(1),
                      help="Physical micro-batch through the layers. Larger costs VRAM for its buffers and saves "
                           "the GPU's per-micro-batch work: a GPU server with room prefills waves of prompts "
                           "faster at -ub 2048. hybrid serve's default is auto: -b where every layer is on the GPU "
                           "with room for the larger buffers, else 512.")
]
ThreadsOpt = Annotated[
    int,
    typer.Option("-t", "--threads", callback=_threads,
                 help="CPU threads: 1 to this machine's logical CPUs (-1 or 0 = one per physical core)."),
]
CtkOpt = Annotated[str, typer.Option("-ctk", "--cache-type-k", help="KV cache type for K: f16, q8_0, q4_0, f32.")]
CtvOpt = Annotated[str, typer.Option("-ctv", "--cache-type-v", help="KV cache type for V: f16, q8_0, q4_0, f32.")]
NglOpt = Annotated[
    str,
    typer.Option("-ngl", "--n-gpu-layers", help="Layers on the GPU: N (repeating layers + output, as llama.cpp), 'auto' or 'all'."),
]
SeedOpt = Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1 = random). Same seed, same output.")]
TempOpt = Annotated[float, typer.Option("--temp", callback=_finite, help="Temperature (0 or below = greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k sampling (0 = off).")]
TopPOpt = Annotated[
    float, typer.Option("--top-p", callback=_top_p, help="Top-p (nucleus) sampling, in (0, 1] (1.0 = off).")
]
MinPOpt = Annotated[float, typer.Option("--min-p", callback=_finite, help="Min-p sampling (0.0 = off).")]
RepeatPenaltyOpt = Annotated[
    float, typer.Option("--repeat-penalty", callback=_repeat_penalty, help="Penalize repeated tokens (1.0 = off).")
]
RepeatLastNOpt = Annotated[
    int,
    typer.Option("--repeat-last-n", callback=at_least(-1, "all"),
                 help="Tokens the penalties look back over (-1 = all)."),
]
PresenceOpt = Annotated[
    float, typer.Option("--presence-penalty", callback=_finite, help="Presence penalty (0.0 = off).")
]
FrequencyOpt = Annotated[
    float, typer.Option("--frequency-penalty", callback=_finite, help="Frequency penalty (0.0 = off).")
]
ChatTemplateOpt = Annotated[
    Optional[str],
    typer.Option("--chat-template", help="Built-in template name (gemma, chatml, llama3, llama2, harmony) or a jinja2 file."),
]
VramBudgetOpt = Annotated[
    Optional[str],
    typer.Option("--vram-budget", help="Act like a card with this much VRAM, e.g. 24GiB (default: the GPU's free memory)."),
]
NumaOpt = Annotated[
    Optional[str],
    typer.Option("--numa", help="NUMA: distribute (interleave the weights over the nodes, spread threads over them), "
                 "isolate (threads and weights on the node we started on), numactl (the CPU map numactl gave us). "
                 "A no-op on a one-node machine."),
]
MlockOpt = Annotated[
    bool,
    typer.Option("--mlock", help="Lock the CPU-resident weights in RAM (never paged out; needs a high `ulimit -l`)."),
]
NoOpOffloadOpt = Annotated[
    bool,
    typer.Option("--no-op-offload",
                 help="Keep CPU-resident layers on the CPU (by default batches of >= 32 tokens multiply their "
                      "weights on the GPU, streamed over PCIe, as llama.cpp does, and so do a server's decode steps "
                      "of several sequences where that measured faster)."),
]
NoMmapOpt = Annotated[bool, typer.Option("--no-mmap", help="Read the model into memory instead of memory-mapping it.")]
NoRepackOpt = Annotated[
    bool,
    typer.Option("-nr", "--no-repack",
                 help="Keep the CPU layers' Q4_0, Q5_0, Q4_K, IQ4_XS and MXFP4 weights as in the file (by default they are copied "
                      "at load into 8-row groups the CPU reads faster, as llama.cpp repacks; the file's pages are "
                      "given back). Op offload (a GPU with layers left on the CPU) keeps the file's layout anyway. Also the MXFP4 "
                      "and Q4_0 routed experts that GPU layers keep in RAM (--n-cpu-moe, -ot), unless --moe-cache is on."),
]
OverrideTensorOpt = Annotated[
    list[str],
    typer.Option("-ot", "--override-tensor",
                 help="REGEX=DEVICE[,...] (repeatable): tensors whose name the regex finds go to DEVICE (CPU or "
                      "CUDA0); the first match wins, others follow their layer (-ngl). Use it to keep routed experts "
                      "in RAM: -ot 'blk\\.(1[0-9])\\.ffn_.*_exps=CPU'."),
]
CpuMoeOpt = Annotated[
    bool,
    typer.Option("-cmoe", "--cpu-moe", help="Keep every layer's routed experts in RAM, computed by the CPU "
                                            "(attention, norms, router and shared experts still follow -ngl)."),
]
NCpuMoeOpt = Annotated[
    int,
    typer.Option("-ncmoe", "--n-cpu-moe", callback=at_least(0),
                 help="Keep the routed experts of the first N layers in RAM (with -ngl 99: the rest of the model on "
                      "the GPU). `hybrid probe` finds the smallest N that fits."),
]


def _moe_cache(value: str) -> str:
    try:
        parse_moe_cache(value)
    except HybridError as exc:
        raise typer.BadParameter(f"'{value}': give slots a layer (32), a total size (6GiB), 'auto' or 0") from exc
    return value


def _moe_cache_policy(value: str) -> str:
    from hybrid.backends.moe_cache.policy import POLICIES  # noqa: PLC0415

    if value not in POLICIES:
        raise typer.BadParameter(f"'{value}': give one of {', '.join(POLICIES)}")
    return value


MoeCacheOpt = Annotated[
    str,
    typer.Option("--moe-cache", callback=_moe_cache,
                 help="A GPU cache of the hot routed experts of GPU layers whose experts stay in RAM (--n-cpu-moe, "
                      "-ot): SLOTS a layer (32), a total SIZE (6GiB), or 'auto' (what the plan leaves of the VRAM "
                      "budget, less a margin); 0 = off. Hits run on the GPU, misses on the CPU."),
]
MoeCachePolicyOpt = Annotated[
    str,
    typer.Option("--moe-cache-policy", callback=_moe_cache_policy,
                 help="Which cached expert a new one replaces: lru, lfu or lfru (docs/MOE_CACHE.md)."),
]
MoeCacheInsertsOpt = Annotated[
    int,
    typer.Option("--moe-cache-inserts", callback=at_least(-1, "no cap"),
                 help="Experts uploaded into the cache a layer a decode step, at most."),
]
CpuMaskOpt = Annotated[
    Optional[str],
    typer.Option("-C", "--cpu-mask",
                 help="CPUs the threads may use, as a hex mask (0x3 = CPUs 0 and 1); one thread per physical core."),
]
CpuRangeOpt = Annotated[
    Optional[str],
    typer.Option("-Cr", "--cpu-range", help="CPUs the threads may use, as LO-HI (0-3); with -C, their union."),
]


@dataclass(frozen=True)
class Flag:
    annotation: Any  # one of the Annotated declarations above
    default: Any
    to_fields: Callable[[Any], dict]  # the flag's value -> EngineParams fields


def _cpus(values: dict) -> dict:
    return {"cpus": select_cpus(values.get("cpu_mask"), values.get("cpu_range"))}


ENGINE_FLAGS: dict[str, Flag] = {
    "ctx": Flag(CtxOpt, 4096, lambda v: {"n_ctx": v}),
    "batch": Flag(BatchOpt, 2048, lambda v: {"n_batch": v}),
    "ubatch": Flag(UBatchOpt, 512, lambda v: {"n_ubatch": v}),
    "threads": Flag(ThreadsOpt, -1, lambda v: {"n_threads": max(v, 0)}),  # -1 and 0: one per physical core
    "ctk": Flag(CtkOpt, "f16", lambda v: {"type_k": v}),
    "ctv": Flag(CtvOpt, "f16", lambda v: {"type_v": v}),
    "ngl": Flag(NglOpt, "0", lambda v: {"n_gpu_layers": v}),
    "vram_budget": Flag(VramBudgetOpt, None, lambda v: {"vram_budget": parse_size(v) if v else None}),
    "numa": Flag(NumaOpt, None, lambda v: {"numa": check_numa_mode(v or "")}),
    "mlock": Flag(MlockOpt, False, lambda v: {"use_mlock": v}),
    "no_mmap": Flag(NoMmapOpt, False, lambda v: {"use_mmap": not v}),
    "no_op_offload": Flag(NoOpOffloadOpt, False, lambda v: {"op_offload": not v}),
    "no_repack": Flag(NoRepackOpt, False, lambda v: {"repack": not v}),
    "override_tensor": Flag(OverrideTensorOpt, [], lambda v: {}),  # with cpu_moe, n_cpu_moe: in engine_params
    "cpu_moe": Flag(CpuMoeOpt, False, lambda v: {}),
    "n_cpu_moe": Flag(NCpuMoeOpt, 0, lambda v: {}),
    "moe_cache": Flag(MoeCacheOpt, "0", lambda v: {"moe_cache": parse_moe_cache(v)}),
    "moe_cache_policy": Flag(MoeCachePolicyOpt, DEFAULT_POLICY, lambda v: {"moe_cache_policy": v}),
    "moe_cache_inserts": Flag(MoeCacheInsertsOpt, DEFAULT_INSERTS, lambda v: {"moe_cache_inserts": v}),
    "cpu_mask": Flag(CpuMaskOpt, None, lambda v: {}),  # with cpu_range, in _cpus
    "cpu_range": Flag(CpuRangeOpt, None, lambda v: {}),
}
LOAD_FLAGS = tuple(ENGINE_FLAGS)  # all of them: run, chat, perplexity
# what bench takes as run does, without sweeping it (bench sweeps --moe-cache itself)
SYSTEM_FLAGS = ("numa", "mlock", "no_mmap", "cpu_mask", "cpu_range", "moe_cache_policy", "moe_cache_inserts")


def engine_params(values: dict[str, Any]) -> EngineParams:
    """EngineParams from flag values by name (usage errors raised as typer.BadParameter)."""
    fields: dict = {}
    try:
        for name, value in values.items():
            fields.update(ENGINE_FLAGS[name].to_fields(value))
        if "cpu_mask" in values or "cpu_range" in values:
            fields.update(_cpus(values))
        if {"override_tensor", "cpu_moe", "n_cpu_moe"} & set(values):
            fields["overrides"] = build_overrides(values.get("override_tensor") or (), bool(values.get("cpu_moe")),
                                                  int(values.get("n_cpu_moe") or 0))
        return EngineParams(**fields)
    except HybridError as exc:
        raise typer.BadParameter(str(exc)) from None


def engine_flags(*names: str, **defaults: Any) -> Callable:
    """Decorator: the command gains the flags `names` (after its own options, defaults overridden by
    `defaults`) and receives them as one `params: EngineParams` argument instead."""

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "params"]
        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(n, ENGINE_FLAGS[n].default),
                                   annotation=ENGINE_FLAGS[n].annotation) for n in names]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            values = {n: kwargs.pop(n, defaults.get(n, ENGINE_FLAGS[n].default)) for n in names}
            return fn(params=engine_params(values), **kwargs)

        params = own + added
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
