"""`--explain`: the placement plan as a table (layers, bytes on GPU and CPU, KV cache, headroom)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gguf_io import ModelConfig
from hybrid.system.devices import probe_gpus
from hybrid.engine.params import EngineParams
from hybrid.plan.budget import plan_for
from hybrid.plan.explain import plan_rows
from hybrid.plan.placement import PlacementPlan
from hybrid.system.sizes import format_size

from hybrid.cli.common import open_model


def explain_plan(model: str | None, params: EngineParams) -> PlacementPlan:
    """The plan `hybrid run` with these flags uses (plan_for, as the engine and the probe call it); pure
    arithmetic when --vram-budget is given (no GPU needed)."""
    budget = params.vram_budget
    if budget is None:
        gpus, _ = probe_gpus()
        budget = gpus[0].free_bytes if gpus else None
    with open_model(model) as f:
        config = ModelConfig.from_gguf(f)
        return plan_for(config, f.tensors, budget, params.n_gpu_layers,
                        params.plan_inputs(params.n_ctx or config.n_ctx_train))


def plan_json(p: PlacementPlan) -> dict:
    """The plan's totals and per-layer devices, for --explain --json."""
    return {"n_gpu_layers": p.n_gpu_layers, "n_offloadable": p.n_layer + 1, "budget_bytes": p.budget_bytes,
            "gpu_total_bytes": p.gpu_total_bytes, "cpu_total_bytes": p.cpu_total_bytes,
            "gpu_kv_bytes": p.gpu_kv_bytes, "gpu_scratch_bytes": p.gpu_scratch_bytes,
            "headroom_bytes": p.headroom_bytes, "devices": [lp.device for lp in p.layers] + [p.output.device]}


def render_plan(p: PlacementPlan, console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    t = plan_rows(p, collapse=True)
    table = Table(title=f"placement: {t.n_gpu_layers}/{t.n_offloadable} layers on the GPU (-ngl {t.n_gpu_layers})")
    for col, just in (("tensors", "left"), ("device", "left"), ("weights", "right"), ("KV cache", "right"),
                      ("note", "left")):
        table.add_column(col, justify=just)
    for r in t.rows:
        table.add_row(escape(r.name), escape(r.device), format_size(r.weight_bytes),
                      format_size(r.kv_bytes) if r.kv_bytes else "", escape(r.note))  # rich reads "[x]" as markup
    console.print(table)
    budget = "no GPU" if not t.budget_bytes else format_size(t.budget_bytes)
    console.print(f"GPU {format_size(t.gpu_bytes)} of {budget}"
                  + (f", headroom {format_size(t.headroom_bytes)}" if t.budget_bytes else "")
                  + f"; CPU {format_size(t.cpu_bytes)}")
    for reason in p.reasons:
        console.print(f"  {escape(reason)}")
