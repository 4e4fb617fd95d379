"""`hybrid bench --spec-type …`: the speculative sweep (drafters × --draft-max) over the tg tests, and its fields
and table cells (hybrid.tools.bench_spec runs each test)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import typer

from hybrid.engine.params import EngineParams
from hybrid.generate.draft import NgramDrafter
from hybrid.generate.draft_model import ModelDrafter
from hybrid.generate.speculative import Speculator
from hybrid.tools.bench import BenchTest, run_bench
from hybrid.tools.bench_spec import CODE_PROMPT, SpecBenchResult, run_spec_bench

from hybrid.cli.session import read_text_file
from hybrid.cli.spec_options import load_draft

KINDS = ("none", "ngram", "draft")


@dataclass
class SpecSweep:
    kinds: list[str]
    draft_maxes: list[int]
    fixed: bool
    prompt: str
    model_draft: str = ""
    ngl_draft: str = "0"
    _draft: object = field(default=None, repr=False)  # the draft engine, loaded once

    @classmethod
    def parse(cls, spec_type: str, model_draft: str, ngl_draft: str, draft_maxes: list[int], fixed: bool,
              prompt_file: str) -> SpecSweep | None:
        """None when --spec-type is not given; usage errors as typer.BadParameter."""
        kinds = [k.strip() for k in spec_type.split(",") if k.strip()]
        if not kinds:
            if model_draft:
                raise typer.BadParameter("-md needs --spec-type draft (or none,draft to compare)")
            return None
        bad = [k for k in kinds if k not in KINDS]
        if bad:
            raise typer.BadParameter(f"--spec-type {bad[0]!r}: give {', '.join(KINDS)} (comma-separated)")
        if "draft" in kinds and not model_draft:
            raise typer.BadParameter("--spec-type draft needs a draft model: -md FILE")
        if not draft_maxes or min(draft_maxes) < 1:
            raise typer.BadParameter("--draft-max takes counts >= 1")
        prompt = read_text_file(prompt_file) if prompt_file else CODE_PROMPT
        return cls(kinds, draft_maxes, fixed, prompt, model_draft, ngl_draft)

    def run(self, engine, tests: list[BenchTest], reps: int, load: Callable) -> Iterator[SpecBenchResult]:
        """pp tests as usual; each tg test once per drafter and draft length (none: once)."""
        plain = [t for t in tests if t.n_gen == 0]
        yield from run_bench(engine, plain, reps)
        ids = engine.tokenizer.encode(self.prompt, add_special=True, parse_special=True)
        for test in (t for t in tests if t.n_gen > 0):
            if test.n_prompt:
                raise typer.BadParameter("-pg tests do not combine with --spec-type; use -p and -n")
            for kind in self.kinds:
                for k in (self.draft_maxes if kind != "none" else [0]):
                    res = run_spec_bench(engine, ids, test.n_gen, reps, self._factory(engine, kind, k, load))
                    res.kind, res.draft_max = kind, k
                    yield res

    def _factory(self, engine, kind: str, k: int, load: Callable) -> Callable[[], Speculator | None]:
        if kind == "none":
            return lambda: None
        adaptive = not self.fixed
        if kind == "ngram":
            return lambda: Speculator(NgramDrafter(3, k, 1), k, 1, adaptive)
        draft = self._draft_engine(engine, load)
        return lambda: Speculator(ModelDrafter(draft, engine.config.n_vocab, 0.75 if adaptive else 0.0), k, 1,
                                  adaptive)

    def _draft_engine(self, engine, load: Callable):
        if self._draft is None:
            params: EngineParams = replace(engine.params, n_gpu_layers=self.ngl_draft, overrides=())
            self._draft = load_draft(self.model_draft, params, engine, lambda m, p: load(m, p, warn_ctx=False))
        return self._draft


def spec_fields(res) -> dict:
    """The JSON fields of a row of the sweep (plain pp rows: spec_type none)."""
    if not isinstance(res, SpecBenchResult):
        return {"spec_type": "none", "draft_max": 0}
    s = res.spec
    return {"spec_type": res.kind, "draft_max": res.draft_max, "n_generated": res.n_generated,
            "n_drafted": s.drafted, "n_accepted": s.accepted, "acceptance_rate": s.rate,
            "mean_accepted": s.mean_accepted, "n_drafts": s.drafts, "n_steps": s.steps, "draft_ms": s.draft_ms,
            "acceptance_at": [a / d for a, d in zip(s.accepted_at, s.drafted_at) if d]}


def spec_cells(row: dict) -> list[str]:
    kind = row.get("spec_type", "none")
    if kind == "none":
        return ["-", "-"]
    return [f"{kind}/{row['draft_max']}", f"{row['acceptance_rate']:.2f}"]


def spec_note(row: dict) -> str:
    if row.get("spec_type", "none") == "none":
        return ""
    return f", {row['spec_type']}/{row['draft_max']}, acceptance {row['acceptance_rate']:.2f}"
