"""`hybrid probe`: predict the largest -ngl, measure the real ceiling on the device (bisecting allocation
attempts), recommend a value with headroom, compare KV cache types, check the rest of the tuning checklist,
and print the command line to run."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from functools import partial
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gguf_io import ModelConfig
from hybrid.system.devices import probe_gpus, probe_machine
from hybrid.engine.engine import Engine
from hybrid.engine.params import EngineParams
from hybrid.errors import DeviceUnavailable, HybridError
from hybrid.kv.types import check_kv_types
from hybrid.model.files import resolve_model
from hybrid.plan.budget import plan_for
from hybrid.plan.moe_cache import MoeCacheRequest
from hybrid.plan.probe import DEFAULT_MARGIN_BYTES, kv_type_table
from hybrid.engine.fit import cache_alternative, probe_n_cpu_moe, probe_ngl, try_fit
from hybrid.plan.overrides import FFN_EXPS_REGEX, cpu_moe_overrides
from hybrid.plan.checks import gpu_link_checks, mlock_check, numa_check, thread_sweep, threads_check
from hybrid.system.sizes import format_size, parse_size

from hybrid.cli.common import cache_dir
from hybrid.cli.options import ModelArgument, ModelOpt, engine_flags
from hybrid.cli.session import note


@engine_flags("ctx", "ctk", "ctv", "ubatch", "vram_budget", "no_op_offload", "override_tensor", "cpu_moe", "n_cpu_moe",
              "moe_cache")
def probe(
    model: ModelArgument = None,
    model_opt: ModelOpt = None,  # merged into `model` while the flags are parsed
    margin: Annotated[Optional[str], typer.Option("--margin", help="Headroom to leave below the ceiling (default 1GiB).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only the predicted plan: no GPU needed (give --vram-budget).")] = False,
    fast: Annotated[bool, typer.Option("--fast", help="Skip the measured thread sweep.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print everything as one JSON object.")] = False,
    params: EngineParams = EngineParams(),
) -> None:
    """Find the OOM ceiling: the most layers (-ngl) that fit, predicted from the plan and measured on the GPU by
    allocating and running each candidate; then recommend -ngl with headroom, a KV type, -t, --mlock, --numa.

    An MoE model that does not fit whole: the smallest --n-cpu-moe with all else on the GPU, measured the same way.

    If some layers' experts stay on the GPU, also --cpu-moe with an expert cache in the VRAM it frees (predicted)."""
    ctk, ctv, ubatch = check_kv_types(params.type_k, params.type_v) + (params.n_ubatch,)  # before any planning
    try:
        margin_bytes = parse_size(margin) if margin else DEFAULT_MARGIN_BYTES
    except HybridError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--margin'") from None
    path = resolve_model(model, cache_dir())
    if dry_run and params.vram_budget is None:
        raise HybridError("--dry-run predicts against a budget: give --vram-budget SIZE (e.g. --vram-budget 24GiB)")
    gpus, why = probe_gpus() if not dry_run else ((), "dry run")
    if params.vram_budget is not None:
        budget = params.vram_budget
    elif gpus:
        budget = gpus[0].free_bytes
    else:
        raise DeviceUnavailable(f"{why}: give --vram-budget SIZE (with --dry-run) to predict a plan")
    if not dry_run and not gpus:
        raise DeviceUnavailable(f"measuring the ceiling needs a GPU ({why}); use --dry-run for the prediction only")
    from gguf_io import open_gguf  # noqa: PLC0415

    with open_gguf(path) as f:
        config, tensors = ModelConfig.from_gguf(f), dict(f.tensors)
    n_ctx = params.n_ctx or config.n_ctx_train
    if n_ctx > config.n_ctx_train > 0:
        note(f"warning: -c {n_ctx} is larger than the model's training context {config.n_ctx_train}")
    params = replace(params, n_ctx=n_ctx, n_batch=max(ubatch, 512))  # every plan below: what `run` would plan
    fit = None if dry_run else partial(try_fit, path, params, budget_bytes=budget)
    def progress(a) -> None:
        if not json_out:
            note(f"  -ngl {a.ngl}: {'fits' if a.fits else 'out of memory'} (peak {format_size(a.peak_bytes)})")

    result = probe_ngl(config, tensors, params, budget, margin_bytes, fit, progress)
    rec = result.recommendation
    report: dict = {"model": str(path), "n_ctx": n_ctx, "type_k": ctk, "type_v": ctv, "n_ubatch": ubatch,
                    "budget_bytes": budget, "n_offloadable": config.n_layer + 1,
                    "predicted_ngl": result.prediction.ngl}
    if not dry_run:
        report.update(measured_ceiling=result.ceiling, attempts=[dataclasses.asdict(a) for a in result.attempts],
                      probe_seconds=result.seconds)
    moe = None
    n_max = config.n_layer + 1
    if config.n_expert and not params.overrides and rec.ngl < n_max:  # experts in RAM beat whole layers there
        moe_fit = None if dry_run else (lambda pp: try_fit(path, pp, n_max, budget))

        def moe_progress(a) -> None:
            if not json_out:
                note(f"  -ngl {n_max} --n-cpu-moe {a.ngl}: {'fits' if a.fits else 'out of memory'} "
                     f"(peak {format_size(a.peak_bytes)})")

        moe = probe_n_cpu_moe(config, tensors, params, budget, margin_bytes, moe_fit, moe_progress)
        report.update(moe=dataclasses.asdict(moe))
    use_moe = moe is not None and moe.fits
    if use_moe:
        params = replace(params, overrides=cpu_moe_overrides(n_cpu_moe=moe.recommended))
    rec_ngl = n_max if use_moe else rec.ngl
    kv_rows = kv_type_table(config, tensors, budget, params.plan_inputs(), margin_bytes=margin_bytes)
    p = plan_for(config, tensors, budget, max(rec_ngl, 0), params.plan_inputs())
    if p.n_cpu_moe and params.moe_cache.kind in ("off", "auto"):  # the expert cache it leaves room for
        p = plan_for(config, tensors, budget, max(rec_ngl, 0),
                     replace(params, moe_cache=MoeCacheRequest("auto")).plan_inputs())
    machine = probe_machine(with_gpu=False)
    sweep = None
    if not fast and not dry_run:
        counts = sorted({max(1, machine.physical_cores // 4), max(1, machine.physical_cores // 2), machine.physical_cores})
        engine = Engine.load(path, EngineParams(n_ctx=256, n_batch=256, n_ubatch=256, type_k=ctk, type_v=ctv,
                                                n_gpu_layers=rec_ngl, vram_budget=budget,
                                                overrides=params.overrides))
        try:
            sweep = thread_sweep(engine, counts)
        finally:
            engine.close()
    checks = [threads_check(machine, sweep), mlock_check(machine, p.cpu_total_bytes), numa_check(machine)]
    if gpus:
        checks += gpu_link_checks()
    tail = ([f"-ctk {ctk}", f"-ctv {ctv}"] if ctk != "f16" or ctv != "f16" else [])
    tail += [f"-t {checks[0].value}"] + [c.value for c in checks[1:] if c.value]
    tail += [] if params.op_offload else ["--no-op-offload"]

    def command(moe_flags: list[str], plan) -> str:
        cache = [f"--moe-cache {plan.moe_cache.slots}"] if plan.moe_cache.on else []
        return f"hybrid run {path} " + " ".join([f"-ngl {rec_ngl}"] + moe_flags + [f"-c {n_ctx}"] + tail + cache)

    moe_flags = [f"--n-cpu-moe {moe.recommended}"] if use_moe else []
    moe_flags += [f"-ot '{o}'" for o in params.overrides if o.explicit]
    moe_flags += ["--cpu-moe"] if any(not o.explicit and o.pattern == FFN_EXPS_REGEX for o in params.overrides) else []
    alt = cache_alternative(config, tensors, params, budget, n_max) \
        if use_moe and 0 < moe.recommended < moe.n_layer else None
    report.update(recommended_ngl=rec_ngl, recommended_n_cpu_moe=moe.recommended if use_moe else None,
                  margin_bytes=margin_bytes, recommendation=dataclasses.asdict(rec),
                  kv_types=[dataclasses.asdict(r) for r in kv_rows], checks=[dataclasses.asdict(c) for c in checks],
                  thread_sweep=sweep, command=command(moe_flags, p),
                  moe_cache={"slots": p.moe_cache.slots, "bytes": p.moe_cache.bytes, "note": p.moe_cache.note},
                  cache_alternative=None if alt is None else {
                      "command": command(["--cpu-moe"], alt), "slots": alt.moe_cache.slots,
                      "bytes": alt.moe_cache.bytes, "note": alt.moe_cache.note, "plan_gpu_bytes": alt.gpu_total_bytes},
                  plan_gpu_bytes=p.gpu_total_bytes, plan_cpu_bytes=p.cpu_total_bytes)
    if json_out:
        print(json.dumps(report, indent=2))
    else:
        _render(report, kv_rows, checks, dry_run)


def _render(r: dict, kv_rows, checks, dry_run: bool) -> None:
    con = Console()
    # the model path and the command on lines of their own that rich does not wrap (a path stays whole); every
    # string that may hold brackets escaped, so rich does not read it as markup
    con.print(f"hybrid probe: {escape(r['model'])}", soft_wrap=True)
    t = Table(title=f"ceiling at -c {r['n_ctx']}, budget {format_size(r['budget_bytes'])}", show_header=False)
    t.add_row("predicted ceiling", f"-ngl {r['predicted_ngl']} of {r['n_offloadable']}")
    if not dry_run:
        t.add_row("measured ceiling", f"-ngl {r['measured_ceiling']} ({len(r['attempts'])} attempts, "
                                      f"{r['probe_seconds']} s)")
        d = r["measured_ceiling"] - r["predicted_ngl"]
        if abs(d) > 1:
            t.add_row("", f"[yellow]prediction off by {d:+d} layers[/yellow]")
    moe = r.get("moe")
    if moe is not None:
        fits = moe["recommended"] <= moe["n_layer"]
        t.add_row("predicted --n-cpu-moe", f"{moe['predicted']} of {moe['n_layer']} at -ngl {r['n_offloadable']}"
                  if moe["predicted"] <= moe["n_layer"] else "none fits: the rest of the model alone is too big")
        if moe["measured"] is not None:
            t.add_row("measured --n-cpu-moe", f"{moe['measured']} ({len(moe['attempts'])} attempts, "
                                              f"{moe['seconds']} s)" if moe["measured"] <= moe["n_layer"] else "none fits")
        if fits:
            t.add_row("recommended", f"-ngl {r['recommended_ngl']} --n-cpu-moe {moe['recommended']} (headroom >= "
                                     f"{format_size(r['margin_bytes'])}): attention, router and KV cache of every "
                                     f"layer on the GPU, the routed experts of the first {moe['recommended']} in RAM")
    if moe is None or moe["recommended"] > moe["n_layer"]:
        t.add_row("recommended", f"-ngl {r['recommended_ngl']} (headroom >= {format_size(r['margin_bytes'])})")
    if r["moe_cache"]["note"]:
        t.add_row("expert cache", escape(r["moe_cache"]["note"]))
    t.add_row("GPU / CPU bytes", f"{format_size(r['plan_gpu_bytes'])} / {format_size(r['plan_cpu_bytes'])}")
    con.print(t)
    kv = Table(title="KV cache types at this context")
    for col in ("type", "KV cache", "max -ngl", "safe -ngl", "layers gained"):
        kv.add_column(col)
    for row in kv_rows:
        kv.add_row(row.type_k, format_size(row.kv_bytes), str(row.max_ngl), str(row.safe_ngl), f"{row.extra_layers:+d}")
    con.print(kv)
    ck = Table(title="checklist")
    for col in ("check", "status", "detail"):
        ck.add_column(col)
    for c in checks:
        status = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]"}.get(c.status, escape(c.status))
        ck.add_row(escape(c.name), status, escape(c.detail))
    con.print(ck)
    con.print(f"\n[bold]{escape(r['command'])}[/bold]", soft_wrap=True)
    alt = r.get("cache_alternative")
    if alt:
        con.print(f"\nor every layer's routed experts in RAM and {alt['slots']} hot experts a layer cached on the GPU "
                  f"({format_size(alt['bytes'])}): faster decode when the routing is skewed; prompt batches "
                  f"upload the experts they use that are not cached", soft_wrap=True)
        con.print(f"[bold]{escape(alt['command'])}[/bold]", soft_wrap=True)
