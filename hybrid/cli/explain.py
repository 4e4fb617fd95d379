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
from hybrid.plan.overrides import unused_warnings
from hybrid.plan.placement import PlacementPlan
from hybrid.system.sizes import format_size

from hybrid.cli.common import open_model
from hybrid.cli.session import note


def explain_plan(model: str | None, params: EngineParams) -> tuple[PlacementPlan, dict[str, int]]:
    """The plan `hybrid run` with these flags uses (plan_for, as the engine and the probe call it) and the bytes of
    every tensor; pure arithmetic when --vram-budget is given (no GPU needed). An override that matches no
    tensor is said in a warning line."""
    budget = params.vram_budget
    if budget is None:
        gpus, _ = probe_gpus()
        budget = gpus[0].free_bytes if gpus else None
    with open_model(model) as f:
        config = ModelConfig.from_gguf(f)
        for line in unused_warnings(f.tensors, params.overrides):
            note(line)
        p = plan_for(config, f.tensors, budget, params.n_gpu_layers,
                     params.plan_inputs(params.n_ctx or config.n_ctx_train))
        return p, {name: t.nbytes for name, t in f.tensors.items()}


def plan_json(p: PlacementPlan, tensors: dict[str, int]) -> dict:
    """The plan's totals, per-layer devices (attention and dense FFN with the layer; routed experts where they
    live), and every tensor with its device and bytes, for --explain --json."""
    layers = [{"index": lp.index, "device": lp.device, "experts": "cpu" if lp.experts_on_cpu or lp.device == "cpu"
               else "gpu" if lp.expert_bytes else None, "weight_bytes": lp.weight_bytes,
               "expert_bytes": lp.expert_bytes, "kv_bytes": lp.kv_bytes} for lp in p.layers]
    rows = [{"name": name, "device": p.tensor_device(name), "bytes": nbytes} for name, nbytes in tensors.items()]
    if p.output.tied and p.output.device == "gpu":
        rows.append({"name": "output.weight (a GPU copy of token_embd.weight)", "device": "gpu",
                     "bytes": p.output.head_bytes})
    return {"n_gpu_layers": p.n_gpu_layers, "n_offloadable": p.n_layer + 1, "budget_bytes": p.budget_bytes,
            "gpu_total_bytes": p.gpu_total_bytes, "cpu_total_bytes": p.cpu_total_bytes,
            "gpu_weight_bytes": p.gpu_weight_bytes, "cpu_weight_bytes": p.cpu_weight_bytes,
            "gpu_kv_bytes": p.gpu_kv_bytes, "gpu_scratch_bytes": p.gpu_scratch_bytes,
            "headroom_bytes": p.headroom_bytes, "n_cpu_moe": p.n_cpu_moe,
            "moe_cache": {"slots": p.moe_cache.slots, "bytes": p.moe_cache.bytes, "layers": list(p.moe_cache.layers),
                          "note": p.moe_cache.note},
            "override_tensors": [str(o) for o in p.overrides],
            "devices": [lp.device for lp in p.layers] + [p.output.device], "layers": layers, "tensors": rows}


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
