"""The engine: a plan turned into a running model (load, eval), how front ends start one, and measured fits."""

from hybrid.engine.engine import Engine
from hybrid.engine.params import EngineParams

__all__ = ["Engine", "EngineParams"]
