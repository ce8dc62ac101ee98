"""When speculation costs more than it saves: a per-step rule from measured acceptance and step time.

A step of T tokens is modelled as ``a + b * T`` seconds, fitted online (least squares over the
recent steps). With per-position acceptance alpha, K drafts yield on average
``E = (1 - alpha^(K+1)) / (1 - alpha)`` tokens per request and step (Leviathan et al.), for
``K+1`` scheduled tokens instead of one. At batch size B speculation pays when
``E / (a + b*B*(K+1)) > 1 / (a + b*B)``: at batch 1 the fixed cost ``a`` dominates and it pays; at
high concurrency the step is compute-bound and only high acceptance pays. Every
``probe_every``-th step does the opposite of the rule, so both acceptance (while off) and the
plain step's cost (while on) stay measured and the rule can switch either way. A step that
speculates only to measure (a probe, or one of the first steps, taken while one step size is
known) gives drafts to ``probe_rows`` requests, not the whole batch: acceptance is measured as
well from a few rows, and at high concurrency a step of B*(K+1) tokens costs several plain ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens per verification of k drafts with i.i.d. per-position acceptance alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class AutoOffDecision:
    speculate: bool
    gain: float  # predicted tokens-per-second ratio of speculating over not
    reason: str = "gain"  # "gain": the model decided; "measure": b unknown yet; "probe": the other way
    rows: int = 0  # speculating: at most this many requests get drafts (0: all of them)

    def describe(self) -> str:
        """One line for the step record: the decision, why, the predicted gain, any row limit."""
        rows = f", {self.rows} rows" if self.speculate and self.rows else ""
        return f"{'on' if self.speculate else 'off'} ({self.reason}, gain {self.gain:.2f}{rows})"


class SpecAutoOff:
    def __init__(self, k: int, window: int = 400, probe_every: int = 100, ewma: float = 0.1,
                 prior_alpha: float = 0.5, probe_rows: int = 4) -> None:
        self.k = k
        self.probe_rows = probe_rows
        # Longer than probe_every, so the window always holds a step of the other size.
        self.steps: deque[tuple[int, float]] = deque(maxlen=max(window, 2 * probe_every))
        self.probe_every = probe_every
        self.ewma = ewma
        self.alpha = prior_alpha
        self._since_probe = 0
        self._last = True

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.steps.append((num_tokens, seconds))

    def observe_acceptance(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One step's drafts: the per-position acceptance estimate moves toward their rate."""
        if num_draft_tokens:
            rate = num_accepted_tokens / num_draft_tokens
            self.alpha += self.ewma * (rate - self.alpha)

    def cost_model(self) -> tuple[float, float]:
        """(a, b) of ``seconds = a + b * tokens``; b = 0 until two distinct sizes were seen."""
        n = len(self.steps)
        if n == 0:
            return 0.0, 0.0
        mean_t = sum(t for t, _ in self.steps) / n
        mean_s = sum(s for _, s in self.steps) / n
        var = sum((t - mean_t) ** 2 for t, _ in self.steps)
        b = 0.0 if var == 0 else max(
            0.0, sum((t - mean_t) * (s - mean_s) for t, s in self.steps) / var)
        return max(mean_s - b * mean_t, 0.0), b

    def decide(self, batch_size: int) -> AutoOffDecision:
        a, b = self.cost_model()
        plain = a + b * batch_size
        spec = a + b * batch_size * (self.k + 1)
        gain = expected_tokens(self.alpha, self.k) * plain / spec if spec > 0 else 1.0
        speculate = gain >= 1.0
        reason = "gain"
        self._since_probe += 1
        if len({t for t, _ in self.steps}) < 2:
            # At most one step size seen: b is unknown, so the next step tries the other size
            # (the first one plain: with nothing measured, the model has no say).
            speculate, reason = not self._last, "measure"
        elif self._since_probe >= self.probe_every:
            # Every probe_every-th step does the other thing: off, it keeps acceptance measured;
            # on, it keeps the cost of a plain step (b needs two step sizes) measured.
            self._since_probe = 0
            speculate, reason = not speculate, "probe"
        self._last = speculate
        return AutoOffDecision(speculate, gain, reason, self.probe_rows if speculate and reason != "gain" else 0)
