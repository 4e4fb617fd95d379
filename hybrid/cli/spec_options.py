"""The speculative-decoding flags of `run`, `chat` and `serve` (llama.cpp's names), and the Speculator they make:
`--spec-type ngram` drafts by prompt lookup; `-md FILE` drafts with a smaller model of the same vocabulary, loaded
with its own placement (`-ngld`) and threads (`-td`) beside the target."""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, replace
from typing import Annotated, Any, Callable, Optional

import numba
import typer

from hybrid.engine.params import EngineParams
from hybrid.generate.draft import NgramDrafter
from hybrid.generate.draft_model import ModelDrafter, check_vocab
from hybrid.generate.speculative import Speculator

from hybrid.cli.options import _threads, at_least

SPEC_TYPES = ("none", "ngram", "ngram-simple", "draft")


def _spec_type(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in SPEC_TYPES:
        raise typer.BadParameter(f"{value!r}: give one of {', '.join(SPEC_TYPES)}")
    return value


def _p_min(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise typer.BadParameter(f"{value}: give a probability in [0, 1]")
    return value


SpecTypeOpt = Annotated[Optional[str], typer.Option(
    "--spec-type", callback=_spec_type,
    help="Speculative decoding: 'ngram' drafts by prompt lookup (tokens that followed the last n tokens earlier in "
         "the text), 'draft' with the -md model (implied by -md); every draft is verified exactly by the model, so "
         "the output is what plain decoding gives. Default: off.")]
DraftMaxOpt = Annotated[int, typer.Option(
    "--draft-max", "--draft-n", callback=at_least(1),
    help="Most tokens per draft (each step drafts the length that pays best for the measured acceptance and cost "
         "of a check, up to this).")]
DraftMinOpt = Annotated[int, typer.Option("--draft-min", callback=at_least(0), help="Fewest tokens worth a draft.")]
DraftPMinOpt = Annotated[float, typer.Option(
    "--draft-p-min", callback=_p_min,
    help="-md: stop a draft before a token the draft model gives less than this probability.")]
NgramNOpt = Annotated[int, typer.Option(
    "--spec-ngram-n", callback=at_least(1),
    help="--spec-type ngram: suffix length looked up (then shorter, down to 2).")]
ModelDraftOpt = Annotated[Optional[str], typer.Option(
    "-md", "--model-draft",
    help="Draft model: a smaller GGUF with the target's vocabulary (a path or a known name).")]
NglDraftOpt = Annotated[Optional[str], typer.Option(
    "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft",
    help="-md: the draft model's layers on the GPU (as -ngl; default: the target's -ngl).")]
ThreadsDraftOpt = Annotated[int, typer.Option(
    "-td", "--threads-draft", callback=_threads, help="-md: CPU threads for the draft model (default: -t's).")]


@dataclass(frozen=True)
class SpecOptions:
    spec_type: Optional[str] = None
    draft_max: int = 8
    draft_min: int = 1
    draft_p_min: float = 0.75
    spec_ngram_n: int = 3
    model_draft: Optional[str] = None
    ngl_draft: Optional[str] = None
    threads_draft: int = -1

    @property
    def kind(self) -> str:
        """none, ngram or draft (checked: usage errors as typer.BadParameter)."""
        kind = {"ngram-simple": "ngram", None: "none"}.get(self.spec_type, self.spec_type)
        if self.model_draft is not None:
            if kind == "ngram":
                raise typer.BadParameter("--spec-type ngram and -md are two drafters: give one")
            kind = "draft"
        elif kind == "draft":
            raise typer.BadParameter("--spec-type draft needs a draft model: -md FILE")
        if self.draft_min > self.draft_max:
            raise typer.BadParameter(f"--draft-min {self.draft_min} is above --draft-max {self.draft_max}")
        return kind


_FLAGS: dict[str, tuple[Any, Any]] = {
    "spec_type": (SpecTypeOpt, None),
    "draft_max": (DraftMaxOpt, 8),
    "draft_min": (DraftMinOpt, 1),
    "draft_p_min": (DraftPMinOpt, 0.75),
    "spec_ngram_n": (NgramNOpt, 3),
    "model_draft": (ModelDraftOpt, None),
    "ngl_draft": (NglDraftOpt, None),
    "threads_draft": (ThreadsDraftOpt, -1),
}


def spec_flags(fn: Callable) -> Callable:
    """Decorator: the command gains the speculative-decoding flags and receives them as one `spec: SpecOptions`
    argument (put it inside engine_flags, which passes the other keywords through)."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "spec"]
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
             for n, (a, d) in _FLAGS.items()]

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        values = {n: kwargs.pop(n, d) for n, (_, d) in _FLAGS.items()}
        return fn(spec=SpecOptions(**values), **kwargs)

    params = own + added
    command.__signature__ = sig.replace(parameters=params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def draft_params(spec: SpecOptions, params: EngineParams) -> EngineParams:
    """The draft model's EngineParams: the target's, with -ngld for -ngl, -td for -t and no tensor overrides."""
    ngl = params.n_gpu_layers if spec.ngl_draft is None else spec.ngl_draft
    threads = params.n_threads if spec.threads_draft <= 0 else spec.threads_draft
    return replace(params, n_gpu_layers=ngl, n_threads=max(threads, 0), overrides=())


def _threads_around(n: int) -> Callable:
    """A context manager factory: numba's worker count set to n during the draft model's evaluations."""

    @contextlib.contextmanager
    def around():
        before = numba.get_num_threads()
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
        try:
            yield
        finally:
            numba.set_num_threads(before)

    return around


def load_draft(model: str, params: EngineParams, target, load: Callable):
    """The draft model's engine for target: loaded by load(model, params) with the target's context size, its
    vocabulary checked against the target's (VocabMismatch, one line, the draft engine closed), warmed up."""
    draft, _ = load(model, replace(params, n_ctx=target.params.n_ctx))
    try:
        check_vocab(target.tokenizer, draft.tokenizer)
    except BaseException:
        draft.close()
        raise
    draft.warmup()
    return draft


def make_speculator(spec: SpecOptions, engine, params: EngineParams, load: Callable) -> Speculator | None:
    """The Speculator the flags ask for (None: off). load(model, params) -> (engine, load_ms) loads a draft model;
    its vocabulary is checked against the target's (VocabMismatch, one line, when it differs)."""
    kind = spec.kind
    if kind == "none":
        return None
    if kind == "ngram":
        drafter = NgramDrafter(spec.spec_ngram_n, spec.draft_max, spec.draft_min)
    else:
        dparams = draft_params(spec, params)
        draft_engine = load_draft(spec.model_draft, dparams, engine, load)
        around = _threads_around(dparams.n_threads) if spec.threads_draft > 0 else None
        drafter = ModelDrafter(draft_engine, engine.config.n_vocab, spec.draft_p_min, around_eval=around)
    return Speculator(drafter, spec.draft_max, spec.draft_min)


def spec_summary(stats) -> str:
    """One line of speculative counts after a generation (llama.cpp's `draft acceptance` line, with ours)."""
    at = ", ".join(f"{a / d:.2f}" for a, d in zip(stats.accepted_at, stats.drafted_at) if d)
    return (f"     speculative: {stats.drafted} drafted, {stats.accepted} accepted (rate {stats.rate:.3f}, mean "
            f"accepted length {stats.mean_accepted:.2f}, {stats.drafts} drafts in {stats.steps} steps, drafting "
            f"{stats.draft_ms:.1f} ms); acceptance by position: {at or '-'}")
