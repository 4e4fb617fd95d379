"""Timings of one generation, as llama.cpp reports them (load, prompt eval, eval, sampling, total)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Timings:
    load_ms: float = 0.0
    prompt_ms: float = 0.0
    prompt_tokens: int = 0
    eval_ms: float = 0.0
    eval_tokens: int = 0  # generated tokens that went through the model (llama.cpp's "eval" count)
    sample_ms: float = 0.0
    total_ms: float = 0.0  # wall time from after the warm-up to the end (llama.cpp's "total time")

    @staticmethod
    def rate(n: int, ms: float) -> float:
        return 1000.0 * n / ms if ms > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "load_ms": self.load_ms,
            "prompt_n": self.prompt_tokens, "prompt_ms": self.prompt_ms,
            "prompt_per_second": self.rate(self.prompt_tokens, self.prompt_ms),
            "predicted_n": self.eval_tokens, "predicted_ms": self.eval_ms,
            "predicted_per_second": self.rate(self.eval_tokens, self.eval_ms),
            "sample_ms": self.sample_ms,
            "total_ms": self.total_ms,
        }
