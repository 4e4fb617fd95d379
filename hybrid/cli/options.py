"""Typer option declarations shared by run/chat/perplexity/bench (llama.cpp's flag names)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

CtxOpt = Annotated[int, typer.Option("-c", "--ctx-size", help="Context size in tokens (0 = the model's training context).")]
BatchOpt = Annotated[int, typer.Option("-b", "--batch-size", help="Logical batch: prompt tokens per eval call.")]
UBatchOpt = Annotated[int, typer.Option("-ub", "--ubatch-size", help="Physical micro-batch through the layers.")]
ThreadsOpt = Annotated[int, typer.Option("-t", "--threads", help="CPU threads (0 = number of physical cores).")]
CtkOpt = Annotated[str, typer.Option("-ctk", "--cache-type-k", help="KV cache type for K: f16, q8_0, q4_0, f32.")]
CtvOpt = Annotated[str, typer.Option("-ctv", "--cache-type-v", help="KV cache type for V: f16, q8_0, q4_0, f32.")]
NglOpt = Annotated[
    str,
    typer.Option("-ngl", "--n-gpu-layers", help="Layers on the GPU: N (repeating layers + output, as llama.cpp), 'auto' or 'all'."),
]
SeedOpt = Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1 = random). Same seed, same output.")]
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature (0 = greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k sampling (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Top-p (nucleus) sampling (1.0 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p sampling (0.0 = off).")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", help="Penalize repeated tokens (1.0 = off).")]
RepeatLastNOpt = Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalties look back over (-1 = all).")]
PresenceOpt = Annotated[float, typer.Option("--presence-penalty", help="Presence penalty (0.0 = off).")]
FrequencyOpt = Annotated[float, typer.Option("--frequency-penalty", help="Frequency penalty (0.0 = off).")]
ChatTemplateOpt = Annotated[
    Optional[str],
    typer.Option("--chat-template", help="Built-in template name (gemma, chatml, llama3, llama2) or a jinja2 file."),
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
                 help="Keep the prefill of CPU-resident layers on the CPU (by default batches of >= 32 tokens multiply "
                      "their weights on the GPU, streamed over PCIe, as llama.cpp does)."),
]
NoMmapOpt = Annotated[bool, typer.Option("--no-mmap", help="Read the model into memory instead of memory-mapping it.")]
NoRepackOpt = Annotated[
    bool,
    typer.Option("-nr", "--no-repack",
                 help="Keep the CPU layers' Q4_0, Q5_0 and Q4_K weights as in the file (by default they are copied "
                      "at load into 8-row groups the CPU reads faster, as llama.cpp repacks; the file's pages are "
                      "given back). Op offload (a GPU with layers left on the CPU) keeps the file's layout anyway."),
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
