"""The decode model: what a batched sample call costs, one function for the runtime's scheduler
and the simulator.

A decode step over `b` live rows costs `step_s + row_s * b` (continuous batching, memory-bound:
`step_s` reads every weight once, `row_s` is each row's compute and KV traffic), and a prompt
costs `prefill_token_s` per token. A call whose rows decode `L_i` tokens each, in `steps` steps
(the longest row's length when every row fits a slot at once), therefore takes

    seconds = step_s * steps + row_s * sum(L_i) + prefill_token_s * prompt_tokens.

The runtime estimates a queued batch with it (scheduler.py, the head's E_i in the switch-aware
priority), the simulator decodes replicas with it (sim/latency.py `JobCosts`), and `plexrl sim
calibrate` fits it by least squares from the runtime's `batch` events (steps, live row-steps,
prompt tokens, device seconds), as `Telemetry` does online from the same figures.

Invariants: `seconds` is linear in its arguments (arrays broadcast, elementwise); `fit` of
figures made by a model returns that model (exactly, up to float rounding) once they span it;
a fit never returns a negative coefficient (non-negative least squares over the three).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class DecodeModel:
    step_s: float  # one decode step, whatever its rows (t0)
    row_s: float  # one live row in one step (c)
    prefill_token_s: float = 0.0  # one prompt token

    def seconds(self, steps, row_steps, prompt_tokens=0.0):
        """A call of `steps` decode steps over `row_steps` live row-steps (= the tokens sampled)
        and `prompt_tokens` prefilled; numpy arrays broadcast."""
        return self.step_s * steps + self.row_s * row_steps + self.prefill_token_s * prompt_tokens

    def batch_s(self, rows: Sequence[tuple[int, int, int]], slots: int) -> float:
        """A batch of requests (num_samples, prompt tokens, max_tokens) in `slots` slots: rows
        decode their max_tokens, each request prefills once; with more rows than slots the
        steps are those of waves of `slots` rows (a bound: finished rows free their slots)."""
        lengths = sorted((tokens for n, _, tokens in rows for _ in range(n)), reverse=True)
        steps = sum(lengths[::max(1, slots)])  # each wave lasts as long as its longest row
        return float(self.seconds(steps, sum(lengths), sum(prompt for _, prompt, _ in rows)))

    @classmethod
    def fit(cls, figures: Sequence[tuple[float, float, float, float]]) -> "DecodeModel | None":
        """Least squares over (steps, row_steps, prompt_tokens, seconds) of measured calls, the
        coefficients kept non-negative (a coefficient the figures push below zero is dropped
        and the rest refitted); None without figures."""
        data = np.asarray(figures, dtype=np.float64).reshape(-1, 4)
        if not len(data):
            return None
        x, y = data[:, :3], data[:, 3]
        kept = [i for i in range(3) if x[:, i].any()]
        while kept:
            coef, *_ = np.linalg.lstsq(x[:, kept], y, rcond=None)
            if (coef >= 0).all():
                full = np.zeros(3)
                full[kept] = coef
                return cls(float(full[0]), float(full[1]), float(full[2]))
            kept = [i for i, c in zip(kept, coef) if c > min(coef)]  # drop the most negative
        return cls(0.0, 0.0, 0.0)


@dataclass
class DecodeEstimator:
    """Per model, the decode model fitted to its latest `kept` batched calls (the runtime's
    Telemetry feeds it each call's figures). Until a model has `least` calls its estimate is
    None (the caller falls back to its per-function average): a fit of three coefficients needs
    that many calls to say anything."""

    kept: int = 64
    least: int = 3
    _figures: dict[str, list[tuple[float, float, float, float]]] = field(default_factory=dict)
    _fits: dict[str, DecodeModel] = field(default_factory=dict)

    def observe(self, model: str, steps: int, row_steps: int, prompt_tokens: int, seconds: float) -> None:
        figures = self._figures.setdefault(model, [])
        figures.append((steps, row_steps, prompt_tokens, seconds))
        del figures[:-self.kept]
        if len(figures) >= self.least:
            self._fits[model] = DecodeModel.fit(figures)

    def estimate(self, model: str, rows: Sequence[tuple[int, int, int]], slots: int) -> float | None:
        """Seconds of a batch of `rows` (num_samples, prompt tokens, max_tokens) in `slots` slots."""
        fitted = self._fits.get(model)
        return None if fitted is None else fitted.batch_s(rows, slots)
