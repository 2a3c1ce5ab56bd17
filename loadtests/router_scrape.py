"""The processor's router metrics (services/processor/metrics.py RouterMetrics) as a benchmark reads
them: one scrape of its /metrics page before a run and one after, and their difference.

    kvmesh_router_decisions_total{policy, reason}    engines chosen
    kvmesh_router_seconds                            time to choose one (histogram)
    kvmesh_router_prediction_error_tokens            engine's cached tokens - router's prediction (histogram)
    kvmesh_router_mispredictions_total               of those, off by more than one block

Quantiles come from the histogram's buckets, interpolated linearly within the bucket that holds the
rank, as Prometheus' histogram_quantile does: exact at bucket bounds, an estimate between them. A
processor without these metrics (one from before the router) gives a scrape with `exported` False.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import fetch_page

DECISIONS = "kvmesh_router_decisions"  # family names as the parser gives them: counters without _total
SECONDS = "kvmesh_router_seconds"
PREDICTION_ERROR = "kvmesh_router_prediction_error_tokens"
MISPREDICTIONS = "kvmesh_router_mispredictions"


@dataclass(frozen=True)
class RouterScrape:
    exported: bool  # the page has the router's metrics at all
    decisions: dict[tuple[str, str], float]  # (policy, reason) -> engines chosen
    seconds: dict[float, float]  # bucket upper bound (s, +inf included) -> decisions that took at most that
    predictions: float  # requests whose prediction was checked against the engine's report
    mispredictions: float  # of those, off by more than one block

    @classmethod
    def parse(cls, page: str) -> RouterScrape:
        decisions: dict[tuple[str, str], float] = {}
        seconds: dict[float, float] = {}
        predictions = mispredictions = 0.0
        names: set[str] = set()
        for family in text_string_to_metric_families(page):
            names.add(family.name)
            for sample in family.samples:
                if sample.name == f"{DECISIONS}_total":
                    key = (sample.labels["policy"], sample.labels["reason"])
                    decisions[key] = decisions.get(key, 0.0) + sample.value
                elif sample.name == f"{SECONDS}_bucket":
                    le = float(sample.labels["le"])
                    seconds[le] = seconds.get(le, 0.0) + sample.value
                elif sample.name == f"{PREDICTION_ERROR}_count":
                    predictions += sample.value
                elif sample.name == f"{MISPREDICTIONS}_total":
                    mispredictions += sample.value
        exported = {DECISIONS, SECONDS, PREDICTION_ERROR, MISPREDICTIONS} <= names
        return cls(exported, decisions, dict(sorted(seconds.items())), predictions, mispredictions)

    @classmethod
    def fetch(cls, url: str, timeout: float) -> RouterScrape:
        return cls.parse(fetch_page(url, timeout))

    def since(self, before: RouterScrape) -> RouterScrape:
        """What happened between `before` and this scrape (of the same process: counters only grow)."""
        decisions = {k: v - before.decisions.get(k, 0.0) for k, v in self.decisions.items()}
        seconds = {le: n - before.seconds.get(le, 0.0) for le, n in self.seconds.items()}
        return RouterScrape(self.exported and before.exported, {k: v for k, v in decisions.items() if v}, seconds,
                            self.predictions - before.predictions, self.mispredictions - before.mispredictions)

    def routing_seconds(self, q: float) -> float:
        """The q-th percentile (0-100) of the time to choose an engine, s; nan without decisions."""
        return histogram_quantile(list(self.seconds.items()), q / 100)

    @property
    def accuracy(self) -> float | None:
        """Share of checked predictions within one block of the engine's cached tokens; None: none checked."""
        if self.predictions <= 0:
            return None
        return 1 - self.mispredictions / self.predictions


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs sorted by bound, the
    last +inf. The rank q * total falls in one bucket; the value is interpolated linearly between its
    lower bound (the previous bound; 0 for the first) and its upper bound. A rank in the +inf bucket
    gives the largest finite bound. nan for an empty histogram."""
    if not 0 <= q <= 1:
        raise ValueError(f"a quantile is between 0 and 1, got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    assert math.isinf(buckets[-1][0]), "the last bucket of a histogram is +Inf"
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for i, (upper, count) in enumerate(buckets):
        if count >= rank and count > below:
            if math.isinf(upper):
                return buckets[i - 1][0] if i else math.nan
            if i == 0 and upper <= 0:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    raise AssertionError(f"no bucket holds rank {rank} of {buckets}")  # the +inf bucket holds every rank
