"""Placement as byte arithmetic, no hardware: the plan, the one plan builder (budget), explain, the probe's logic."""
