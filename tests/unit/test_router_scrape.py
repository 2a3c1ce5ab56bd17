"""loadtests/router_scrape.py: the router's metrics read back from a real Prometheus exposition page
(prometheus_client's), the difference of two scrapes, and quantiles interpolated within a bucket as
Prometheus' histogram_quantile does."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from loadtests.router_scrape import RouterScrape, histogram_quantile

INF = math.inf


class Router:
    """The processor's kvmesh_router_* families as services/processor/metrics.py exports them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["component", "policy", "reason"]
        self.decisions = Counter("kvmesh_router_decisions", "", labels, registry=self.registry)
        self.seconds = Histogram("kvmesh_router_seconds", "", ["component"], buckets=(0.001, 0.002, 0.005),
                                 registry=self.registry).labels("processor")
        self.errors = Histogram("kvmesh_router_prediction_error_tokens", "", ["component"], buckets=(-16, 0, 16),
                                registry=self.registry).labels("processor")
        self.mispredictions = Counter("kvmesh_router_mispredictions", "", ["component"],
                                      registry=self.registry).labels("processor")

    def scrape(self) -> RouterScrape:
        return RouterScrape.parse(generate_latest(self.registry).decode())


def test_quantile_interpolates_within_the_bucket_holding_the_rank():
    buckets = [(0.001, 2.0), (0.002, 4.0), (INF, 4.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.001)  # rank 2: the first bucket's top
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.0005)  # rank 1 of 2 in [0, 1 ms]
    assert histogram_quantile(buckets, 0.75) == pytest.approx(0.0015)  # rank 3: 1 of 2 in (1, 2 ms]
    assert histogram_quantile(buckets, 1.0) == pytest.approx(0.002)


def test_quantile_in_the_inf_bucket_is_the_largest_finite_bound_and_empty_is_nan():
    assert histogram_quantile([(0.001, 1.0), (0.002, 1.0), (INF, 2.0)], 0.99) == 0.002
    assert math.isnan(histogram_quantile([(0.001, 0.0), (INF, 0.0)], 0.5))
    assert math.isnan(histogram_quantile([], 0.5))
    with pytest.raises(ValueError, match="between 0 and 1"):
        histogram_quantile([(INF, 1.0)], 50)


def test_the_difference_of_two_scrapes_holds_only_what_happened_between():
    router = Router()
    router.decisions.labels("processor", "kv-aware", "no_hit").inc(3)
    router.seconds.observe(0.004)
    router.errors.observe(64)
    router.mispredictions.inc()
    before = router.scrape()
    for seconds in (0.0005, 0.0005, 0.0015, 0.0015):
        router.seconds.observe(seconds)
    router.decisions.labels("processor", "kv-aware", "prefix_hit").inc(4)
    for error in (0, 0, 0, 32):
        router.errors.observe(error)
    router.mispredictions.inc()

    run = router.scrape().since(before)

    assert run.exported
    assert run.decisions == {("kv-aware", "prefix_hit"): 4.0}
    assert run.seconds == {0.001: 2.0, 0.002: 4.0, 0.005: 4.0, INF: 4.0}
    assert run.routing_seconds(50) == pytest.approx(0.001)
    assert run.routing_seconds(75) == pytest.approx(0.0015)
    assert (run.predictions, run.mispredictions) == (4.0, 1.0)
    assert run.accuracy == pytest.approx(0.75)


def test_a_page_without_the_router_metrics_is_not_exported_and_has_no_accuracy():
    registry = CollectorRegistry()
    Counter("kvmesh_processor_requests", "", registry=registry).inc()
    scrape = RouterScrape.parse(generate_latest(registry).decode())
    assert not scrape.exported
    assert scrape.accuracy is None
    assert math.isnan(scrape.routing_seconds(99))
    assert not Router().scrape().since(scrape).exported
