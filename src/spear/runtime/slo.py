"""The SLO-aware prefill policy: the largest prompt chunk that keeps the step within the ITL target.

Every running decode gains one token per engine step, so a step's duration is the
inter-token latency its decodes see. Each step the policy asks the latency table for the
most prefill tokens whose predicted step time, beside this step's decodes, stays within
(1 - headroom) x the ITL SLO, and grants that (clamped to [min_chunk, max_chunk]).
Decodes are never stalled (the engine always runs them); where the table has no answer
(empty or partial table, a batch size outside its grid, even the smallest chunk over
budget) the policy grants `min_chunk`, so prompts still progress slowly and safely.
With no decodes running no inter-token latency is at stake: `max_chunk`.

Feedback: the engine reports each step's measured time (`observe`); over the steps the
policy sized (decodes beside a prefill chunk) it keeps the last `window` ratios measured /
predicted, and once it has `min_samples` of them scales every prediction by a high
quantile of them (an exponential moving average until then). The SLO bounds the tail of
the inter-token latency, not its mean: a mean correction centres the step times under the
target and their step-to-step spread (±15-25% on an H200) puts the P99 over it. The quantile
is the one that keeps the P99 of *all* gaps within the SLO: the sized steps carry only a share
f of the gaps (decode-only steps carry the rest), so their ratios are taken at
1 − 0.01 / f (capped at `quantile`). It still corrects within a few steps a table profiled
under other conditions (longer contexts than profiled, a busier device).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from spear.errors import SpearError
from spear.runtime.latency import LatencyTable

if TYPE_CHECKING:
    from spear.runtime.engine import StepStats


@dataclass
class SLOPolicy:
    table: LatencyTable
    itl_slo_ms: float
    min_chunk: int = 16
    max_chunk: int = 512
    # Share of the SLO kept for what the quantile misses: its gap to the P99 and the error of estimating
    # it from `window` steps. Not lowered: simulated lognormal ratios put the P99 step within the SLO up
    # to a spread sigma of 0.15 and at it for 0.2; replaying the H200 traces' ratios, within 1.07x of it.
    headroom: float = 0.1
    smoothing: float = 0.1  # weight of the newest ratio in the moving average used while warming up
    window: int = 64  # recent sized steps whose measured / predicted ratios are kept
    # The ITL percentile the SLO bounds. Only the sized steps can break it, and they carry a share f of
    # the inter-token gaps (each step gives one per decode), so their ratios are taken at the quantile
    # 1 − (1 − itl_percentile) / f: the P99 of all gaps is about that quantile of the sized steps' gaps.
    # On the H200 f was 0.14–0.40 at a 22 ms SLO and about 0.7 at 16 ms.
    itl_percentile: float = 0.99
    # The highest quantile used: near the P99 the SLO is about, yet (in a full window) below its largest
    # ratio, so one outlier step (a hiccup) does not shrink 64 chunks.
    quantile: float = 0.98
    share_smoothing: float = 0.02  # weight of the newest step in the moving average of f
    min_samples: int = 8  # ratios needed before the quantile replaces the moving average
    correction: float = field(default=1.0, init=False)  # factor on every prediction: measured / predicted
    _mean: float = field(default=1.0, init=False, repr=False, compare=False)
    _gaps: list[float] = field(default_factory=lambda: [1.0, 1.0], init=False, repr=False, compare=False)  # sized, all
    _ratios: deque[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.itl_slo_ms <= 0:
            raise SpearError(f"the ITL SLO must be positive, got {self.itl_slo_ms} ms")
        if not 1 <= self.min_chunk <= self.max_chunk:
            raise SpearError(f"need 1 <= min_chunk <= max_chunk, got {self.min_chunk} and {self.max_chunk}")
        if not 0 <= self.headroom < 1 or not 0 < self.smoothing <= 1:
            raise SpearError(f"need 0 <= headroom < 1 and 0 < smoothing <= 1, got {self.headroom} and {self.smoothing}")
        if not 0 < self.quantile <= 1 or not 1 <= self.min_samples <= self.window:
            raise SpearError(f"need 0 < quantile <= 1 and 1 <= min_samples <= window, "
                             f"got {self.quantile}, {self.min_samples} and {self.window}")
        if not 0 < self.itl_percentile < 1 or not 0 < self.share_smoothing <= 1:
            raise SpearError(f"need 0 < itl_percentile < 1 and 0 < share_smoothing <= 1, "
                             f"got {self.itl_percentile} and {self.share_smoothing}")
        self._ratios = deque(maxlen=self.window)

    def predict(self, num_decodes: int, prefill_tokens: int) -> float | None:
        """Corrected step seconds, or None where the table has no answer."""
        seconds = self.table.predict(num_decodes, prefill_tokens)
        return None if seconds is None else seconds * self.correction

    def prefill_budget(self, num_decodes: int, decode_context_tokens: int, waiting_prompt_tokens: int) -> int:
        if num_decodes == 0:
            return self.max_chunk
        target = self.itl_slo_ms / 1e3 * (1 - self.headroom) / self.correction
        tokens = self.table.max_prefill(num_decodes, target)
        if tokens is None:
            return self.min_chunk
        return max(self.min_chunk, min(self.max_chunk, int(tokens + 1e-6)))  # floor, forgiving rounding error

    def observe(self, stats: StepStats) -> None:
        """Fold a finished step's measured time (the engine's StepStats) into the correction.

        Only the steps this policy sized count: decodes beside a prefill chunk, with a prediction. Every
        step with decodes updates their share of the gaps.
        """
        if stats.num_decodes == 0:
            return
        predicted = self.table.predict(stats.num_decodes, stats.num_prefill_tokens) if stats.num_prefill_tokens else None
        sized = predicted is not None and predicted > 0
        for i, gaps in enumerate((stats.num_decodes * sized, stats.num_decodes)):  # smoothed gaps per step
            self._gaps[i] += self.share_smoothing * (gaps - self._gaps[i])
        if not sized:
            return
        ratio = stats.seconds / predicted
        self._mean += self.smoothing * (ratio - self._mean)
        self._ratios.append(ratio)
        if len(self._ratios) < self.min_samples:
            self.correction = self._mean
        else:
            self.correction = float(np.quantile(self._ratios, self._gap_quantile()))  # linear interpolation

    @property
    def sized_share(self) -> float:
        """f: the sized steps' share of the inter-token gaps (smoothed; 1 before any step)."""
        return self._gaps[0] / self._gaps[1]

    def _gap_quantile(self) -> float:
        """The quantile of the sized steps' ratios that keeps `itl_percentile` of all gaps within the SLO."""
        share = max(self.sized_share, 1e-3)
        return min(self.quantile, max(0.5, 1 - (1 - self.itl_percentile) / share))

