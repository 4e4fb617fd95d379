"""`hybrid info`: the model's architecture, sizes and tensor types, and this machine's CPU, RAM, NUMA and GPU."""

from __future__ import annotations

import dataclasses
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybrid.system.devices import MachineInfo, probe_machine
from hybrid.tools.info import ModelSummary, summarize

from hybrid.system.sizes import format_size
from hybrid.cli.common import JsonOpt, fmt_count, open_model
from hybrid.cli.options import ModelArgument, ModelOpt

_CONFIG_FIELDS = (
    "n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_head", "n_head_kv", "n_embd_head_k", "n_ff",
    "n_rot", "rope_type", "rope_freq_base", "rope_freq_base_swa", "f_norm_rms_eps", "n_swa",
    "n_expert", "n_expert_used", "n_ff_exp", "tied_output",
)


def info(model: ModelArgument = None, model_opt: ModelOpt = None, json_out: JsonOpt = False) -> None:
    """Show a model's hyperparameters, parameter count, tensors by quant type, bytes per layer, and this machine."""
    with open_model(model) as f:
        summary = summarize(f)
    machine = probe_machine()
    if json_out:
        print(json.dumps({"model": summary.to_dict(), "machine": dataclasses.asdict(machine)}, indent=2, default=str))
        return
    console = Console()
    _render_model(console, summary)
    _render_machine(console, machine)


def _render_model(console: Console, s: ModelSummary) -> None:
    # every string from the file or this machine is escaped: rich would read "[cuda13]" or "[x]" as markup
    console.print(f"[bold]{escape(str(s.name or s.path))}[/bold]  ({escape(str(s.architecture))}, "
                  f"GGUF v{s.gguf_version})", soft_wrap=True)
    console.print(f"file {escape(str(s.path))}: {format_size(s.file_size, 2)}, {fmt_count(s.n_params)} parameters, "
                  f"{8 * s.file_size / max(s.n_params, 1):.2f} bits per weight", soft_wrap=True)
    hp = Table(title="hyperparameters", show_header=False)
    if s.config is None:
        hp.add_row("config", f"[red]{escape(str(s.config_error))}[/red]")
    else:
        for name in _CONFIG_FIELDS:
            if hasattr(s.config, name):
                hp.add_row(name, escape(str(getattr(s.config, name))))
    hp.add_row("tokenizer", f"{escape(s.tokenizer_model or 'none')} ({s.n_vocab_tokens} tokens)")
    hp.add_row("chat template", "yes" if s.has_chat_template else "no (a built-in one is chosen by architecture)")
    console.print(hp)
    types = Table(title="tensors by type")
    for col in ("type", "tensors", "bytes"):
        types.add_column(col, justify="right" if col != "type" else "left")
    for t in s.types:
        types.add_row(escape(str(t.type_name)), str(t.n_tensors), format_size(t.n_bytes, 2))
    console.print(types)
    layers = Table(title="weight bytes per layer")
    layers.add_column("layer")
    layers.add_column("bytes", justify="right")
    for i, b in enumerate(s.layer_bytes):
        layers.add_row(f"blk.{i}", format_size(b, 2))
    for name, b in s.other_bytes.items():
        layers.add_row(escape(str(name)), format_size(b, 2))
    console.print(layers)


def _render_machine(console: Console, m: MachineInfo) -> None:
    t = Table(title="this machine", show_header=False)
    t.add_row("CPU", escape(m.cpu_model))
    t.add_row("cores", f"{m.physical_cores} physical, {m.logical_cores} logical")
    t.add_row("features", escape(" ".join(m.cpu_features)) or "none of AVX/AVX2/AVX-512/VNNI")
    t.add_row("RAM", f"{format_size(m.ram_total_bytes, 2)} total, {format_size(m.ram_available_bytes, 2)} available")
    t.add_row("NUMA nodes", ", ".join(f"node{n}: cpus {','.join(map(str, c))}" for n, c in m.numa_nodes))
    lim = "unlimited" if m.memlock_soft < 0 else format_size(m.memlock_soft, 2)
    t.add_row("mlock limit", lim)
    if m.gpus:
        for g in m.gpus:
            t.add_row(f"GPU {g.index}", f"{escape(g.name)} (sm {g.compute_capability}), "
                                        f"{format_size(g.free_bytes, 2)} free of {format_size(g.total_bytes, 2)}")
    else:
        t.add_row("GPU", f"none: {escape(m.gpu_error)}")
    console.print(t)
