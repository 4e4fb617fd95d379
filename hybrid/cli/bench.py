"""`hybrid bench`: llama-bench's tests, sweeps and output formats (md, json, csv)."""

from __future__ import annotations

import csv
import datetime
import io
import itertools
import json
import sys
from dataclasses import replace
from typing import Annotated

import typer

from hybrid.tools.bench import BenchResult, run_bench, tests_from
from hybrid.system.devices import probe_machine
from hybrid.engine.params import EngineParams
from hybrid.errors import HybridError
from hybrid.plan.overrides import build_overrides, cpu_moe_overrides, describe
from hybrid.tools.info import model_type

from hybrid.system.sizes import format_size
from hybrid.cli.common import fmt_count
from hybrid.cli.options import SYSTEM_FLAGS, ModelArgument, ModelOpt, check_batch, check_threads, engine_flags
from hybrid.cli.session import load_engine, note
from hybrid.cli.bench_batched import bench_batched
from hybrid.cli.bench_spec import SpecSweep, spec_cells, spec_fields, spec_note
from hybrid.cli.bench_moe_cache import cache_counts, cache_fields, cache_note, cache_sweep


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip() != ""]
    except ValueError:
        raise typer.BadParameter(f"{flag} takes comma-separated integers, got '{text}'") from None


def _strs(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


@engine_flags(*SYSTEM_FLAGS, "vram_budget")  # --vram-budget: what --moe-cache auto sizes from
def bench(
    model: ModelArgument = None,
    model_opt: ModelOpt = None,  # merged into `model` while the flags are parsed
    n_prompt: Annotated[str, typer.Option("-p", "--n-prompt", help="Prompt lengths to test (pp), comma-separated.")] = "512",
    n_gen: Annotated[str, typer.Option("-n", "--n-gen", help="Generation lengths to test (tg), comma-separated.")] = "128",
    pg: Annotated[list[str], typer.Option("-pg", help="Prompt+generation test 'PP,TG' (repeatable).")] = [],
    threads: Annotated[str, typer.Option("-t", "--threads", help="Thread counts, comma-separated (-1 or 0 = one per physical core).")] = "-1",
    ngl: Annotated[str, typer.Option("-ngl", "--n-gpu-layers", help="GPU layer counts, comma-separated.")] = "0",
    ctk: Annotated[str, typer.Option("-ctk", "--cache-type-k", help="K cache types, comma-separated.")] = "f16",
    ctv: Annotated[str, typer.Option("-ctv", "--cache-type-v", help="V cache types, comma-separated.")] = "f16",
    fa: Annotated[str, typer.Option("-fa", "--flash-attn", help="Flash attention 0/1 (the CPU kernel is always flash-style).")] = "1",
    batch: Annotated[str, typer.Option("-b", "--batch-size", help="Batch sizes, comma-separated.")] = "2048",
    ubatch: Annotated[str, typer.Option("-ub", "--ubatch-size", help="Micro-batch sizes, comma-separated.")] = "512",
    nopo: Annotated[str, typer.Option("-nopo", "--no-op-offload", help="1: the CPU layers' prefill stays on the CPU; "
                                      "0: batches of >= 32 tokens run them on the GPU, weights streamed (comma-separated "
                                      "to compare).")] = "0",
    no_repack: Annotated[str, typer.Option("-nr", "--no-repack", help="1: the CPU layers' Q4_0/Q5_0/Q4_K weights (and "
                                           "the MXFP4/Q4_0 experts in RAM of GPU layers) stay as in the file; 0: "
                                           "repacked into 8-row groups at load (not under op offload; "
                                           "comma-separated to compare).")] = "0",
    ncmoe: Annotated[str, typer.Option("-ncmoe", "--n-cpu-moe", help="Layers whose routed experts stay in RAM, run by "
                                       "the CPU (comma-separated to compare).")] = "0",
    cmoe: Annotated[bool, typer.Option("-cmoe", "--cpu-moe", help="Every layer's routed experts in RAM.")] = False,
    moe_cache: Annotated[str, typer.Option("--moe-cache", help="The GPU cache of hot experts in RAM, as run's "
                                           "--moe-cache, comma-separated to compare (auto,0: with and without it); "
                                           "rows gain moe_cache, moe_cache_hit_rate, uploads and bytes per "
                                           "token.")] = "0",
    ot: Annotated[list[str], typer.Option("-ot", "--override-tensor", help="REGEX=DEVICE[,...] (repeatable), as run's "
                                          "-ot.")] = [],
    spec_type: Annotated[str, typer.Option("--spec-type", help="Speculative decoding for the tg tests: none, ngram, "
                                           "draft (the -md model), comma-separated to compare. With it, tg N "
                                           "generates N tokens greedily from a real prompt (-f) instead of random "
                                           "ids; rows gain spec_type, draft_max and the acceptance fields.")] = "",
    model_draft: Annotated[str, typer.Option("-md", "--model-draft", help="Draft model for --spec-type draft.")] = "",
    ngl_draft: Annotated[str, typer.Option("-ngld", "--gpu-layers-draft", help="The draft model's -ngl.")] = "0",
    draft_max: Annotated[str, typer.Option("--draft-max", help="Most tokens per draft, comma-separated.")] = "8",
    spec_fixed: Annotated[bool, typer.Option("--spec-fixed", help="Draft --draft-max tokens at every step (by default "
                                             "the length adapts to the measured acceptance and cost, as in run).")] = False,
    prompt_file: Annotated[str, typer.Option("-f", "--file", help="The prompt of the speculative tg tests (default: "
                                             "a code pattern to continue).")] = "",
    batched: Annotated[bool, typer.Option("--batched", help="llama-batched-bench instead: B sequences of PP prompt "
                                          "tokens prefilled together, then TG steps decoding all B at once; one row "
                                          "per -npp x -ntg x -npl (the first -t, -ngl, -ctk, -ctv, -b, -ub).")] = False,
    npp: Annotated[str, typer.Option("-npp", help="--batched: prompt tokens per sequence, comma-separated.")] = "128",
    ntg: Annotated[str, typer.Option("-ntg", help="--batched: generated tokens per sequence, comma-separated.")] = "128",
    npl: Annotated[str, typer.Option("-npl", help="--batched: sequences in the batch, comma-separated.")] = "1,2,4",
    reps: Annotated[int, typer.Option("-r", "--repetitions", help="Timed repetitions per test.")] = 5,
    output: Annotated[str, typer.Option("-o", "--output", help="Output format: md, json, csv.")] = "md",
    params: EngineParams = EngineParams(),
) -> None:
    """Benchmark prompt processing (pp) and generation (tg) speed, like llama-bench; lists sweep every combination."""
    if output not in ("md", "json", "csv"):
        raise typer.BadParameter(f"-o must be md, json or csv, got '{output}'")
    if batched:
        b0, ub0 = check_batch(_ints(batch, "-b")[0], "'-b'"), check_batch(_ints(ubatch, "-ub")[0], "'-ub'")
        t0 = check_threads(_ints(threads, "-t")[0], "'-t'")
        bench_batched(model, replace(params, n_batch=b0, n_ubatch=ub0, n_threads=max(t0, 0),
                                     n_gpu_layers=_ints(ngl, "-ngl")[0], type_k=_strs(ctk)[0], type_v=_strs(ctv)[0]),
                      _ints(npp, "-npp"), _ints(ntg, "-ntg"), _ints(npl, "-npl"))
        return
    pairs = []
    for item in pg:
        vals = _ints(item, "-pg")
        if len(vals) != 2 or min(vals) < 0:
            raise typer.BadParameter(f"-pg takes 'PP,TG' (two counts >= 0), got '{item}'")
        pairs.append((vals[0], vals[1]))
    tests = tests_from(_ints(n_prompt, "-p"), _ints(n_gen, "-n"), pairs)
    if not tests:
        raise typer.BadParameter("nothing to run: give -p, -n or -pg with values > 0")
    if reps < 1:
        raise typer.BadParameter(f"{reps} is below 1", param_hint="'-r'")
    thread_counts = [check_threads(t, "'-t'") for t in _ints(threads, "-t")]  # before anything is loaded
    batches = [check_batch(b, "'-b'") for b in _ints(batch, "-b")]
    ubatches = [check_batch(ub, "'-ub'") for ub in _ints(ubatch, "-ub")]
    try:
        given = build_overrides(ot, cmoe)  # -ot and --cpu-moe: one set for every row
    except HybridError as exc:
        raise typer.BadParameter(str(exc)) from None
    n_cpu_moes = [v for v in _ints(ncmoe, "-ncmoe")]
    if any(v < 0 for v in n_cpu_moes):
        raise typer.BadParameter(f"-ncmoe takes counts >= 0, got '{ncmoe}'")
    caches = cache_sweep(moe_cache)
    specs = SpecSweep.parse(spec_type, model_draft, ngl_draft, _ints(draft_max, "--draft-max"), spec_fixed,
                            prompt_file)
    machine = probe_machine()
    rows: list[dict] = []
    combos = itertools.product(_ints(ngl, "-ngl"), n_cpu_moes, _strs(ctk), _strs(ctv), _ints(fa, "-fa"), batches,
                               ubatches, thread_counts, _ints(nopo, "-nopo"), _ints(no_repack, "-nr"), caches)
    for n_gl, n_cm, tk, tv, fa_on, b, ub, t, po_off, nr, mc in combos:
        engine, _ = load_engine(model, replace(params, n_ctx=4096, n_batch=b, n_ubatch=ub, type_k=tk, type_v=tv,
                                               n_threads=max(t, 0), n_gpu_layers=n_gl, op_offload=not po_off,
                                               repack=not nr, overrides=given + cpu_moe_overrides(n_cpu_moe=n_cm),
                                               moe_cache=mc),
                                warn_ctx=False)
        import numba  # noqa: PLC0415 - the thread count in effect

        n_threads = numba.get_num_threads()
        results = run_bench(engine, tests, reps) if specs is None else specs.run(engine, tests, reps, load_engine)
        counts = cache_counts(engine)
        for res in results:
            rows.append(_row(engine, res, machine, n_threads, n_gl, tk, tv, fa_on, b, ub))
            rows[-1].update(cache_fields(engine, mc, counts))  # over this test (and its warm-up)
            counts = cache_counts(engine)
            if specs is not None:
                rows[-1].update(spec_fields(res))
            rows[-1]["n_cpu_moe"] = n_cm  # as llama-bench: the count, and the other overrides as one string
            rows[-1]["tensor_buft_overrides"] = rows[-1]["override_tensors"] = describe(given)
            rows[-1]["moe_experts"] = engine.moe_report()
            rows[-1]["no_op_offload"] = int(bool(po_off))
            rows[-1]["no_repack"] = int(bool(nr))
            rows[-1]["op_offload"] = _op_offload(engine)  # batches the GPU ran for CPU layers, bytes streamed
            rows[-1]["gpu_decode"] = _gpu_decode(engine)  # CUDA graphs, or eager launches and why
            if output == "md":
                note(f"{rows[-1]['test']}: {res.avg_ts:.2f} ± {res.stddev_ts:.2f} t/s (t={n_threads}, "
                     f"ncmoe={n_cm}, nopo={int(bool(po_off))}, nr={int(bool(nr))}{spec_note(rows[-1])}"
                     f"{cache_note(rows[-1])})")
        if rows and rows[-1]["gpu_decode"]:
            note(f"GPU decode: {rows[-1]['gpu_decode']}")
        if rows and rows[-1]["moe_experts"] and output == "md":
            note(rows[-1]["moe_experts"])
        if rows and rows[-1]["moe_cache_report"] and output == "md":
            note(rows[-1]["moe_cache_report"])
        engine.close()
    _render(rows, output)


def _row(engine, res: BenchResult, machine, n_threads, n_gl, tk, tv, fa_on, b, ub) -> dict:
    f = engine.gguf
    gpu = ", ".join(g.name for g in machine.gpus)
    return {
        "build_commit": "hybrid", "build_number": 0, "cpu_info": machine.cpu_model, "gpu_info": gpu,
        "backends": "CUDA,CPU" if n_gl > 0 and gpu else "CPU", "model_filename": str(f.path),
        "model_type": model_type(f), "model_size": f.file_size, "model_n_params": f.n_params,
        "n_batch": b, "n_ubatch": ub, "n_threads": n_threads, "type_k": tk, "type_v": tv,
        "n_gpu_layers": n_gl, "flash_attn": bool(fa_on), "use_mmap": engine.params.use_mmap,
        "n_prompt": res.test.n_prompt,
        "n_gen": res.test.n_gen, "n_depth": 0, "test": res.test.name,
        "test_time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "avg_ns": res.avg_ns, "stddev_ns": res.stddev_ns, "avg_ts": res.avg_ts, "stddev_ts": res.stddev_ts,
        "samples_ns": res.samples_ns, "samples_ts": res.samples_ts,
    }


def _render(rows: list[dict], output: str) -> None:
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    if output == "csv":
        buf = io.StringIO()
        keys = [k for k in rows[0] if k not in ("samples_ns", "samples_ts")]
        w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        sys.stdout.write(buf.getvalue())
        return
    spec = any("spec_type" in r for r in rows)
    cached = any(r.get("moe_cache", "0") != "0" for r in rows)
    header = ["model", "size", "params", "backend", "threads", "type_k", "type_v", "ngl", "ncmoe", "nopo", "nr", "test",
              *(["spec", "accept"] if spec else []), *(["moe cache", "hits"] if cached else []), "t/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for r in rows:
        lines.append("| " + " | ".join([
            r["model_type"], format_size(r["model_size"], 2), fmt_count(r["model_n_params"]), r["backends"],
            str(r["n_threads"]), r["type_k"], r["type_v"], str(r["n_gpu_layers"]), str(r["n_cpu_moe"]),
            str(r["no_op_offload"]),
            str(r["no_repack"]), r["test"], *(spec_cells(r) if spec else []),
            *([r["moe_cache"], "" if r["moe_cache_hit_rate"] is None else f"{r['moe_cache_hit_rate']:.3f}"]
              if cached else []),
            f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}",
        ]) + " |")
    print("\n".join(lines))


def _op_offload(engine) -> str:
    """How many batches ran CPU layers on the GPU (op offload) and the weight bytes they streamed, or "off"."""
    off = engine.op_offload
    if off is None:
        return "off"
    return off.describe()


def _gpu_decode(engine) -> str:
    """How the GPU backends ran decode steps so far: CUDA graph counts, or the eager fallback and its reason."""
    gpus = {id(b): b for b in (*engine.backends, engine.output_backend) if hasattr(b, "graph_report")}
    return "; ".join(b.graph_report() for b in gpus.values())
