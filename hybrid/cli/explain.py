"""`--explain`: the placement plan as a table (layers, bytes on GPU and CPU, KV cache, headroom)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from gguf_io import ModelConfig
from hybrid.system.devices import probe_gpus
from hybrid.plan.placement import PlacementPlan, plan
from hybrid.plan.explain import plan_rows
from hybrid.system.sizes import format_size, parse_size

from hybrid.cli.common import open_model


def explain_plan(model: str | None, ngl: str, n_ctx: int, type_k: str, type_v: str, n_ubatch: int,
                 vram_budget: str | None) -> PlacementPlan:
    """The plan `hybrid run` would use; pure arithmetic when --vram-budget is given (no GPU needed)."""
    if vram_budget:
        budget = parse_size(vram_budget)
    else:
        gpus, _ = probe_gpus()
        budget = gpus[0].free_bytes if gpus else None
    with open_model(model) as f:
        config = ModelConfig.from_gguf(f)
        n = ngl if ngl in ("auto", "all") else int(ngl)
        return plan(config, f.tensors, budget, n, n_ctx or config.n_ctx_train, type_k, type_v, n_ubatch,
                    swa_full=True)


def render_plan(p: PlacementPlan, console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    t = plan_rows(p, collapse=True)
    table = Table(title=f"placement: {t.n_gpu_layers}/{t.n_offloadable} layers on the GPU (-ngl {t.n_gpu_layers})")
    for col, just in (("tensors", "left"), ("device", "left"), ("weights", "right"), ("KV cache", "right"),
                      ("note", "left")):
        table.add_column(col, justify=just)
    for r in t.rows:
        table.add_row(r.name, r.device, format_size(r.weight_bytes), format_size(r.kv_bytes) if r.kv_bytes else "",
                      r.note)
    console.print(table)
    budget = "no GPU" if not t.budget_bytes else format_size(t.budget_bytes)
    console.print(f"GPU {format_size(t.gpu_bytes)} of {budget}"
                  + (f", headroom {format_size(t.headroom_bytes)}" if t.budget_bytes else "")
                  + f"; CPU {format_size(t.cpu_bytes)}")
    for reason in p.reasons:
        console.print(f"  {reason}")
