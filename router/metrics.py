"""The router's Prometheus metrics, read from its state when scraped (nothing is counted
twice): per replica, whether it serves, the requests in flight there, the calls routed
there by reason, the calls it refused UNAVAILABLE and that were retried elsewhere, and
how many prompt chunks the router believes it holds cached."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.router.proxy import Router


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator:
        router = self._router
        serving = GaugeMetricFamily(
            "pagoda_router_backend_serving", "1 while the replica says SERVING", labels=["backend"]
        )
        in_flight = GaugeMetricFamily(
            "pagoda_router_in_flight_requests",
            "requests (each of a call's n samples) the router has open on the replica",
            labels=["backend"],
        )
        cached = GaugeMetricFamily(
            "pagoda_router_cached_chunks",
            "prompt chunks the router believes the replica holds cached",
            labels=["backend"],
        )
        retries = CounterMetricFamily(
            "pagoda_router_retries",
            "calls the replica refused UNAVAILABLE before streaming, retried on another",
            labels=["backend"],
        )
        routes = CounterMetricFamily(
            "pagoda_router_routes",
            "calls routed to the replica, by reason (cache, balance, least-loaded, round-robin)",
            labels=["backend", "reason"],
        )
        for backend in router.backends:
            name = backend.address
            serving.add_metric([name], float(backend.serving))
            in_flight.add_metric([name], backend.in_flight)
            cached.add_metric([name], router.num_cached_chunks(name))
            retries.add_metric([name], backend.num_refused)
        for (name, reason), count in sorted(router.num_routes.items()):
            routes.add_metric([name, reason], count)
        yield from (serving, in_flight, cached, retries, routes)


def router_registry(router: Router) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(RouterCollector(router))
    return registry
