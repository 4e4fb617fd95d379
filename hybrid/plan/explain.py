"""A PlacementPlan in words and rows: the reasons it carries, and the table `hybrid run --explain` renders.

Nothing here prints; the CLI renders `plan_rows(plan)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid.system.sizes import format_size

if TYPE_CHECKING:  # placement imports this module; the types are only annotations here
    from hybrid.plan.placement import PlacementPlan


@dataclass(frozen=True)
class ExplainRow:
    name: str  # "token_embd", "blk.7" (or "blk.7-31" collapsed), "blk.0 experts", "output", "compute buffers", ...
    device: str  # "gpu" or "cpu"
    weight_bytes: int  # bytes on `device` besides the KV cache (buffers and overhead count here too)
    kv_bytes: int
    note: str = ""


@dataclass(frozen=True)
class ExplainTable:
    rows: tuple[ExplainRow, ...]
    gpu_bytes: int  # the rows' GPU total (= plan.gpu_total_bytes)
    cpu_bytes: int  # the rows' CPU total (= plan.cpu_total_bytes)
    budget_bytes: int
    headroom_bytes: int
    n_gpu_layers: int
    n_offloadable: int  # n_layer + 1


def plan_rows(plan: PlacementPlan, collapse: bool = False) -> ExplainTable:
    """Rows in model order: token_embd, blk.0 .. blk.{n-1}, output, then the GPU's buffers and overhead.

    collapse=True merges runs of identical consecutive layers into one row ("blk.7-31", bytes summed).
    """
    rows = [ExplainRow("token_embd", "cpu", plan.embedding_bytes, 0, "rows gathered on the CPU")]
    layer_rows: list[tuple[int, ExplainRow]] = []
    for l in plan.layers:
        note = f"sliding window, {l.kv_cells} cells" if l.swa else ""
        if l.device == "gpu" and l.experts_on_cpu:
            layer_rows.append((l.index, ExplainRow(f"blk.{l.index}", "gpu", l.gpu_weight_bytes, l.kv_bytes, note)))
            layer_rows.append((l.index, ExplainRow(f"blk.{l.index} experts", "cpu", l.expert_bytes, 0,
                                                   "routed experts, computed by the CPU")))
        else:
            layer_rows.append((l.index, ExplainRow(f"blk.{l.index}", l.device, l.weight_bytes, l.kv_bytes, note)))
    rows += _collapse(layer_rows) if collapse else [r for _, r in layer_rows]
    out = plan.output
    rows.append(ExplainRow("output", out.device, out.weight_bytes, 0,
                           "tied: a GPU copy of token_embd" if out.tied and out.device == "gpu" else ""))
    if plan.other_bytes:
        rows.append(ExplainRow("other tensors", "cpu", plan.other_bytes, 0))
    if plan.n_gpu_layers:
        s = plan.scratch
        rows.append(ExplainRow("compute buffers", "gpu", s.total, 0, _buffers(s)))
        rows.append(ExplainRow("overhead", "gpu", plan.overhead_bytes, 0, "CUDA context, workspaces"))
    if plan.moe_cache.on:
        c = plan.moe_cache
        where = _layers([l for l in plan.layers if l.index in c.layers])
        rows.append(ExplainRow("expert cache", "gpu", c.bytes, 0, f"--moe-cache: {c.slots} slots a layer, {where}"))
    rows_t = tuple(rows)
    return ExplainTable(
        rows_t,
        sum(r.weight_bytes + r.kv_bytes for r in rows_t if r.device == "gpu"),
        sum(r.weight_bytes + r.kv_bytes for r in rows_t if r.device == "cpu"),
        plan.budget_bytes, plan.headroom_bytes, plan.n_gpu_layers, plan.n_layer + 1,
    )


def _collapse(indexed: list[tuple[int, ExplainRow]]) -> list[ExplainRow]:
    """Merge consecutive layer rows of the same kind (device, bytes, note) into one ranged row."""
    runs: list[list] = []  # [first, last, row, count]
    for il, r in indexed:
        kind = (r.name.endswith("experts"), r.device, r.weight_bytes, r.kv_bytes, r.note)
        prev = runs[-1] if runs else None
        if prev and prev[4] == kind and prev[1] == il - 1:
            prev[1], prev[3] = il, prev[3] + 1
        elif len(runs) >= 2 and runs[-2][4] == kind and runs[-2][1] == il - 1:
            runs[-2][1], runs[-2][3] = il, runs[-2][3] + 1  # interleaved "blk.i" / "blk.i experts" rows
        else:
            runs.append([il, il, r, 1, kind])
    out = []
    for first, last, r, count, _ in runs:
        span = f"{first}" if first == last else f"{first}-{last}"
        suffix = " experts" if r.name.endswith("experts") else ""
        out.append(ExplainRow(f"blk.{span}{suffix}", r.device, r.weight_bytes * count, r.kv_bytes * count, r.note))
    return out


def _layers(layers) -> str:
    """"layers 0-17" for a run, else the indices listed."""
    idx = [l.index for l in layers]
    if idx == list(range(idx[0], idx[-1] + 1)):
        return f"layer {idx[0]}" if len(idx) == 1 else f"layers {idx[0]}-{idx[-1]}"
    return "layers " + ",".join(map(str, idx))


def _span(indices: list[int]) -> str:
    return "none" if not indices else f"{indices[0]}" if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"


def reasons(plan: PlacementPlan, next_parts: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """Why the plan looks as it does, one line each. next_parts: the GPU bytes of one more layer (auto mode)."""
    p, n_max, k = plan, plan.n_layer + 1, plan.n_gpu_layers
    budget = format_size(p.budget_bytes)
    out: list[str] = []
    if str(p.requested_ngl).strip().lower() == "auto":
        if p.budget_bytes == 0:
            out.append("auto: no VRAM budget, everything on the CPU")
        elif next_parts is None:
            out.append(f"auto: all {n_max} layers fit the {budget} budget")
        else:
            what = "nothing" if k == 0 else f"{k} of {n_max} layers"
            out.append(f"auto: {what} fit the {budget} budget; {k + 1} would need {format_size(sum(next_parts))}")
    else:
        out.append(f"-ngl {p.requested_ngl}: {k} of {n_max} layers on the GPU" +
                   (f" ({p.max_fit_ngl} would fit the {budget} budget)" if p.max_fit_ngl > k else ""))
    gpu = [l for l in p.layers if l.device == "gpu"]
    cpu = [l for l in p.layers if l.device == "cpu"]
    if gpu:
        cells = sorted({l.kv_cells for l in gpu}, reverse=True)
        out.append(f"KV cache reserved first: {len(gpu)} GPU layers x {'/'.join(map(str, cells))} cells "
                   f"({p.type_k}/{p.type_v}) = {format_size(p.gpu_kv_bytes)}")
    if k >= 1:
        head = ("tied to token_embd.weight, so a GPU copy of it" if p.output.tied else "output.weight")
        out.append(f"output layer on the GPU first: {head} + output_norm = {format_size(p.output.weight_bytes)}")
    else:
        out.append("output layer on the CPU")
    if not gpu:
        out.append(f"repeating layers: all {p.n_layer} on the CPU")
    else:
        out.append(f"repeating layers on the GPU: {_span([l.index for l in gpu])} (the last {len(gpu)} of "
                   f"{p.n_layer}); on the CPU: {_span([l.index for l in cpu])}")
    out.append(f"token_embd.weight ({format_size(p.embedding_bytes)}) stays on the CPU: its rows are gathered there")
    moe = [l for l in p.layers if l.experts_on_cpu]
    if moe:
        out.append(f"routed experts of {len(moe)} GPU layers stay in RAM, run by the CPU ({_layers(moe)}, "
                   f"{format_size(sum(l.expert_bytes for l in moe))}); their attention, norms and router on the GPU")
    given = [str(o) for o in p.overrides if o.explicit]
    if given:
        out.append(f"-ot, tried in order before --cpu-moe / --n-cpu-moe: {'; '.join(given)}")
    if p.moe_cache.note:
        out.append(p.moe_cache.note)
    if k >= 1:
        out.append(f"compute buffers {format_size(p.scratch.total)} ({_buffers(p.scratch)}) "
                   f"+ overhead {format_size(p.overhead_bytes)}")
    out.append(f"GPU total {format_size(p.gpu_total_bytes)} of the {budget} budget, headroom "
               f"{format_size(p.headroom_bytes)}; CPU {format_size(p.cpu_total_bytes)}")
    if p.headroom_bytes < 0:
        out.append(f"above what auto would pick: the buffers alive at once fit, the pool's slack "
                   f"({format_size(p.scratch.slack)}) may not; `hybrid probe` measures it")
    return tuple(out)


def _buffers(s) -> str:
    staging = f", upload slots of experts in RAM {format_size(s.staging)}" if s.staging else ""
    return (f"peak of live buffers {format_size(s.peak)}: in a layer {format_size(s.activations)}, output layer "
            f"{format_size(s.logits)}{staging}; pool slack {format_size(s.slack)}")
