"""Prometheus metrics of one daemon, in its own CollectorRegistry (never the global one, so a
daemon can be built twice in one process).

Gauges that describe current state (resident bytes, models, leases, sessions) are computed
at scrape time from the cache; counters and the attach-latency histogram are updated as
things happen.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from resident.daemon.cache import LoadObserver

if TYPE_CHECKING:
    from resident.daemon.cache import WeightCache
    from resident.daemon.registry import ResidentModel

ATTACH_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _StateCollector:
    def __init__(self, cache: WeightCache) -> None:
        self.cache = cache

    def collect(self):
        by_place: dict[tuple[str, str], int] = defaultdict(int)
        models = self.cache.registry.models()
        for m in models:
            for slab in m.loaded.slabs:
                by_place[(slab.desc.backend, slab.desc.device)] += slab.desc.nbytes
        resident = GaugeMetricFamily("resident_weights_bytes", "Bytes of resident weights (slabs).",
                                     labels=["backend", "device"])
        if not by_place:
            resident.add_metric([self.cache.backend.name, "cpu"], 0)
        for (backend, device), nbytes in sorted(by_place.items()):
            resident.add_metric([backend, device], nbytes)
        yield resident
        yield GaugeMetricFamily("resident_models", "Resident model versions.", value=len(models))
        yield GaugeMetricFamily("resident_leases", "Live leases.", value=self.cache.sessions.num_leases)
        yield GaugeMetricFamily("resident_sessions", "Live fd-socket sessions.",
                                value=self.cache.sessions.num_sessions)
        yield GaugeMetricFamily("resident_max_bytes", "Cap on resident bytes (0 = unlimited).",
                                value=self.cache.config.max_bytes)
        yield GaugeMetricFamily("resident_last_load_bytes_per_second",
                                "Throughput of the last load (bytes per second).",
                                value=self.cache.last_load_bytes_per_s)


class DaemonMetrics(LoadObserver):
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.attaches = Counter("resident_attaches", "Attaches served.", registry=r)
        self.attach_latency = Histogram("resident_attach_seconds", "Time the daemon spends on an Attach.",
                                        buckets=ATTACH_BUCKETS_S, registry=r)
        self.loads = Counter("resident_loads", "Loads that read a model.", registry=r)
        self.bytes_loaded = Counter("resident_loaded_bytes", "Bytes of weights loaded.", registry=r)
        self.bytes_read = Counter("resident_disk_read_bytes", "Bytes read from disk by loads.", registry=r)
        self.load_seconds = Counter("resident_load_seconds", "Time spent loading.", registry=r)
        self.evictions = Counter("resident_evictions", "Model versions evicted or dropped.", registry=r)
        self._state: _StateCollector | None = None

    def watch(self, cache: WeightCache) -> None:
        """Report the cache's current state at scrape time."""
        if self._state is None:
            self._state = _StateCollector(cache)
            self.registry.register(self._state)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- LoadObserver ---------------------------------------------------------------
    def on_load(self, model: ResidentModel, bytes_read: int, load_s: float) -> None:
        self.loads.inc()
        self.bytes_loaded.inc(model.nbytes)
        self.bytes_read.inc(bytes_read)
        self.load_seconds.inc(load_s)

    def on_attach(self, model: ResidentModel) -> None:
        self.attaches.inc()

    def on_evict(self, model: ResidentModel) -> None:
        self.evictions.inc()
