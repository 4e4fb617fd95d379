"""`hybrid run`: complete a prompt (streaming), then print llama.cpp-style timings; -cnv for a chat."""

from __future__ import annotations

import inspect
import json
import sys
import time
from typing import Annotated, Optional

import typer

from hybrid.engine.params import EngineParams
from hybrid.generate.loop import check_fits, generate
from hybrid.generate.sampling import SamplingParams
from hybrid.generate.speculative import SpecStats
from hybrid.generate.timings import Timings
from hybrid.backends.moe_cache.runtime import expert_cache
from hybrid.system.sizes import format_size
from hybrid.text.stream import TextStream

from hybrid.cli.chat import chat_loop
from hybrid.cli.explain import explain_plan, plan_json, render_plan
from hybrid.cli.options import (LOAD_FLAGS, ChatTemplateOpt, FrequencyOpt, MinPOpt, ModelArgument, ModelOpt,
                                PresenceOpt, RepeatLastNOpt, RepeatPenaltyOpt, SeedOpt, TempOpt, TopKOpt, TopPOpt,
                                at_least, engine_flags)
from hybrid.cli.session import clean_text, load_engine, note, read_text_file
from hybrid.cli.spec_options import SpecOptions, make_speculator, spec_flags, spec_summary

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as llama.cpp exits on Ctrl-C


@engine_flags(*LOAD_FLAGS)
@spec_flags
def run(
    model: ModelArgument = None,
    model_opt: ModelOpt = None,  # merged into `model` while the flags are parsed
    prompt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="The prompt to complete.")] = None,
    file: Annotated[Optional[str], typer.Option("-f", "--file", help="Read the prompt from a file.")] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", callback=at_least(-1, "no limit"),
                                           help="Tokens to generate (-1 = until EOS or the context is full).")] = -1,
    explain: Annotated[bool, typer.Option("--explain", help="Print the placement plan (which layers go where, KV cache, headroom); without -p/-f, only that.")] = False,
    temp: TempOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    repeat_last_n: RepeatLastNOpt = 64,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    seed: SeedOpt = -1,
    conversation: Annotated[bool, typer.Option("-cnv", "--conversation", help="Chat with the model (uses its chat template).")] = False,
    chat_template: ChatTemplateOpt = None,
    system: Annotated[Optional[str], typer.Option("-sys", "--system-prompt", help="System message for -cnv.")] = None,
    special: Annotated[bool, typer.Option("-sp", "--special", help="Print control tokens (e.g. <end_of_turn>) as "
                                          "text; by default they print as nothing, as llama.cpp does.")] = False,
    no_display_prompt: Annotated[bool, typer.Option("--no-display-prompt", help="Do not echo the prompt.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object: prompt_ids, generated_ids, text, timings (with --explain alone: the plan).")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="After the timings, what the devices did: experts in "
                                          "RAM (CPU calls, bytes uploaded per batch), op offload, CUDA graphs.")] = False,
    params: EngineParams = EngineParams(),
    spec: SpecOptions = SpecOptions(),
) -> None:
    """Generate text from a prompt, streaming tokens as they come, then print timings (as llama.cpp does).

    Special tokens written in the prompt (e.g. <start_of_turn>) are parsed as such; BOS is added when the model asks.

    Ctrl-C stops the generation, prints the timings so far and exits with status 130.

    Example: hybrid run -p "The capital of France is" -n 32 --temp 0
    """
    sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                              repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, seed=seed)
    if explain:
        only = prompt is None and file is None and not conversation
        p, tensors = explain_plan(model, params)
        if json_out and only:
            print(json.dumps(plan_json(p, tensors)))
            return
        render_plan(p)
        if only:
            return
    spec.kind  # usage errors before anything loads
    if prompt is not None:
        prompt = clean_text(prompt)
    if conversation:
        engine, load_ms = load_engine(model, params)
        speculator = make_speculator(spec, engine, params, load_engine)
        engine.warmup()
        chat_loop(engine, sampling, n_predict, chat_template, system, prompt, special, speculator)
        return
    if file is not None:
        prompt = read_text_file(file)
    if prompt is None:
        raise typer.BadParameter("give a prompt with -p TEXT or -f FILE (or use -cnv to chat)")
    engine, load_ms = load_engine(model, params)
    speculator = make_speculator(spec, engine, params, load_engine)
    tok = engine.tokenizer
    prompt_ids = tok.encode(prompt, add_special=True, parse_special=True)
    check_fits(len(prompt_ids), engine.params.n_ctx)  # before any work, and before the prompt is echoed
    t0 = time.perf_counter()
    engine.warmup()  # compiles (or loads) the kernels; counted as load time, as llama.cpp's warm-up run
    t_start = time.perf_counter()  # llama.cpp resets its counters after the warm-up: "total time" starts here
    timings = Timings(load_ms=load_ms + 1000 * (t_start - t0))
    stream = TextStream(tok, special=special)
    generated: list[int] = []
    if not json_out and not no_display_prompt:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    cache = engine.new_cache()
    interrupted = False
    stats = SpecStats()
    tokens = (generate(engine, prompt_ids, sampling, n_predict, cache, timings) if speculator is None else
              speculator.generate(engine, prompt_ids, sampling, n_predict, cache, timings, stats=stats))
    try:
        for t in tokens:
            generated.append(t)
            if not json_out:
                sys.stdout.write(stream.push(t))
                sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C: stop here and report what was done
        interrupted = True
    timings.total_ms = 1000 * (time.perf_counter() - t_start)
    if json_out:
        out = {"prompt_ids": prompt_ids, "generated_ids": generated,
               "text": tok.decode(generated, unparse_special=special), "timings": timings.as_dict()}
        if speculator is not None:
            out["speculative"] = stats.as_dict()
        cache = expert_cache(engine)
        if cache is not None:
            ups, nbytes = cache.book.stats.per_token()
            out["moe_cache"] = {"slots": cache.n_slots, "hit_rate": cache.book.stats.hit_rate,
                                "layer_hit_rates": cache.book.stats.layer_hit_rates().tolist(),
                                "uploads_per_token": ups, "bytes_per_token": nbytes}
        if interrupted:
            out["interrupted"] = True
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
        print_timings(timings)
        cache = expert_cache(engine)
        if cache is not None:  # the decode hit rate beside the timings (per layer with --verbose)
            ups, nbytes = cache.book.stats.per_token()
            note(f"       moe cache = {cache.book.stats.hit_rate:10.2%} hits over {cache.book.stats.tokens} tokens, "
                 f"{ups:.2f} uploads ({format_size(int(nbytes), 2)}) per token")
        if speculator is not None:
            note(spec_summary(stats))
        if verbose:
            for line in device_report(engine):
                note(line)
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)


def device_report(engine) -> list[str]:
    """--verbose: one line each for the experts kept in RAM, op offload and the GPU's decode graphs (what applies)."""
    cache = expert_cache(engine)
    lines = [engine.moe_report(), "" if cache is None else cache.book.summary()]
    if engine.op_offload is not None:
        lines.append(f"op offload: {engine.op_offload.describe()}")
    gpus = {id(b): b for b in (*engine.backends, engine.output_backend) if hasattr(b, "graph_report")}
    lines += [f"GPU decode: {b.graph_report()}" for b in gpus.values()]
    return [line for line in lines if line]


def print_timings(t: Timings) -> None:
    """llama.cpp's perf summary, on stderr."""
    note(f"\n       load time = {t.load_ms:10.2f} ms")
    note(f"prompt eval time = {t.prompt_ms:10.2f} ms / {t.prompt_tokens:5d} tokens "
         f"({t.prompt_ms / max(t.prompt_tokens, 1):8.2f} ms per token, {t.rate(t.prompt_tokens, t.prompt_ms):8.2f} tokens per second)")
    note(f"       eval time = {t.eval_ms:10.2f} ms / {t.eval_tokens:5d} runs   "
         f"({t.eval_ms / max(t.eval_tokens, 1):8.2f} ms per token, {t.rate(t.eval_tokens, t.eval_ms):8.2f} tokens per second)")
    note(f"     sample time = {t.sample_ms:10.2f} ms")
    note(f"      total time = {t.total_ms:10.2f} ms / {t.prompt_tokens + t.eval_tokens:5d} tokens")


def chat(**kwargs) -> None:
    """Chat with the model using its chat template (same options as `run -cnv`); the KV cache is kept between turns.

    Ctrl-C stops a reply and returns to the prompt; Ctrl-C there, Ctrl-D or an empty line ends the chat.
    """
    run(**kwargs)


_run_signature = inspect.signature(run, eval_str=True)
chat.__signature__ = _run_signature.replace(parameters=[
    p.replace(default=True) if p.name == "conversation" else p for p in _run_signature.parameters.values()
])
