"""Running estimates the scheduler needs: execution time per (model, function) and transfer
bandwidth per transition kind. Measurements are passed in; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Ewma:
    """Exponentially weighted moving average with a prior used until the first sample."""

    prior: float
    alpha: float = 0.3
    value: float | None = None
    samples: int = 0

    def update(self, x: float) -> None:
        value = self.value
        self.value = x if value is None else self.alpha * x + (1 - self.alpha) * value
        self.samples += 1

    def get(self) -> float:
        return self.prior if self.value is None else self.value


@dataclass
class ExecEstimator:
    """E_i: moving average of measured execution seconds per (model key, function)."""

    prior_s: float = 0.05
    _by_key: dict[tuple[str, str], Ewma] = field(default_factory=dict)
    _by_fn: dict[str, Ewma] = field(default_factory=dict)

    def estimate(self, model: str, fn: str) -> float:
        """The model's own average once it has a sample, else the function's over all models,
        else the prior."""
        own = self._by_key.get((model, fn))
        if own is not None and own.value is not None:
            return own.value
        shared = self._by_fn.get(fn)
        return shared.get() if shared is not None else self.prior_s

    def ewmas(self, model: str, fn: str) -> tuple[Ewma, Ewma]:
        """The (model, function) and the function's averages that `observe` updates: a caller
        that observes the same pair many times (the simulator, once per call) looks them up once
        and calls `Ewma.update` on both, in this order."""
        # get-then-create: setdefault would build a throw-away Ewma on every call (a hot path)
        own = self._by_key.get((model, fn))
        if own is None:
            own = self._by_key[(model, fn)] = Ewma(self.prior_s)
        shared = self._by_fn.get(fn)
        if shared is None:
            shared = self._by_fn[fn] = Ewma(self.prior_s)
        return own, shared

    def observe(self, model: str, fn: str, seconds: float) -> None:
        own, shared = self.ewmas(model, fn)
        own.update(seconds)
        shared.update(seconds)


@dataclass
class BandwidthEstimator:
    """Measured bytes/second per transition kind; feeds T_load and T_offload."""

    prior_bytes_per_s: float = 10e9
    _by_kind: dict[str, Ewma] = field(default_factory=dict)

    def observe(self, kind: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        ewma = self._by_kind.get(kind)
        if ewma is None:
            ewma = self._by_kind[kind] = Ewma(self.prior_bytes_per_s)
        ewma.update(nbytes / seconds)

    def bytes_per_s(self, kind: str) -> float:
        ewma = self._by_kind.get(kind)
        return ewma.get() if ewma is not None else self.prior_bytes_per_s

    def seconds(self, kind: str, nbytes: int) -> float:
        return nbytes / self.bytes_per_s(kind)
