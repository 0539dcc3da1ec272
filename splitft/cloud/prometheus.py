"""``splitft cloud --metrics-port P``: the cloud's live state as a Prometheus endpoint.

What the serving thread counts lives in :mod:`.watch`; this module turns it, and what the server
holds, into metric families when a scrape asks (a custom collector), in a registry of this
server's own, so several clouds in one process (tests, simulations) never share a metric. The
``prometheus_client`` package is the ``metrics`` extra: asking for metrics without it is a
:class:`~splitft.errors.ConfigError` that says what to install.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .watch import BUCKETS, Watch, watch

log = logging.getLogger(__name__)

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
except ImportError:  # the optional 'metrics' extra: Endpoint says what to install
    pass
if TYPE_CHECKING:
    from prometheus_client.core import Metric

#: What the metrics the endpoint serves are called, for docs and tests (all are `splitft_`-prefixed).
NAMES = ("sessions_open", "sessions_opened_total", "sessions_ended_total", "requests_total",
         "optimizer_steps_total", "wire_bytes_total", "request_seconds", "refusals_total",
         "memory_booked_bytes", "memory_limit_bytes", "memory_resident_bytes", "checkpoint_folder_bytes",
         "rank_up")


def available() -> bool:
    """Whether the ``metrics`` extra (prometheus_client) is installed."""
    try:
        importlib.import_module("prometheus_client")
    except ImportError:
        return False
    return True


class CloudCollector:
    """The metric families of one server, read at each scrape (see :data:`NAMES`); a collector as
    prometheus_client's registry takes it (anything with ``collect``)."""

    def __init__(self, server: Any, counts: Watch) -> None:
        self.server, self.counts = server, counts

    def collect(self) -> Iterator[Metric]:
        yield from self._sessions()
        yield from self._traffic()
        yield from self._latency()
        yield from self._memory()
        yield from self._ranks()

    def _sessions(self) -> Iterator[Metric]:
        c = self.counts
        yield GaugeMetricFamily("splitft_sessions_open", "Sessions this process serves now.",
                                value=len(self.server.by_id))
        yield CounterMetricFamily("splitft_sessions_opened", "Sessions opened (or resumed) here.", value=c.opened)
        yield CounterMetricFamily("splitft_sessions_ended", "Sessions ended, expired or evicted here.",
                                  value=c.ended)
        yield _labelled(CounterMetricFamily, "splitft_requests", "Requests dispatched, by message type.",
                        "type", dict(c.requests))
        yield CounterMetricFamily("splitft_optimizer_steps", "Optimizer steps the cloud halves applied.",
                                  value=c.steps())
        yield _labelled(CounterMetricFamily, "splitft_refusals", "Typed error replies, by error code.",
                        "code", dict(c.refusals))

    def _traffic(self) -> Iterator[Metric]:
        family = CounterMetricFamily("splitft_wire_bytes", "Bytes on the wire (headers included), by direction "
                                     "(up: edge to cloud), kind and the codec that carried them.",
                                     labels=("direction", "kind", "codec"))
        for (direction, kind, codec), wire in sorted(self.counts.traffic().items()):
            family.add_metric((direction, kind, codec), wire)
        yield family

    def _latency(self) -> Iterator[Metric]:
        family = HistogramMetricFamily("splitft_request_seconds", "Seconds from a request's dispatch to its "
                                       "reply, by message type.", labels=("type",))
        for kind, latency in sorted(dict(self.counts.latency).items()):
            counts, running, buckets = list(latency.counts), 0, []
            for bound, n in zip((*BUCKETS, float("inf")), counts):
                running += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            family.add_metric((kind,), buckets, latency.total)
        yield family

    def _memory(self) -> Iterator[Metric]:
        server = self.server
        yield GaugeMetricFamily("splitft_memory_booked_bytes", "What the memory book counts the sessions as "
                                "holding (--memory-mb bounds it).", value=sum(list(server.book.held.values())))
        yield GaugeMetricFamily("splitft_memory_limit_bytes", "What all sessions may hold together (--memory-mb).",
                                value=server.limits.memory_bytes)
        resident = resident_bytes()
        if resident is not None:
            yield GaugeMetricFamily("splitft_memory_resident_bytes", "What this process holds in memory (RSS).",
                                    value=resident)
        if server.checkpoints is not None:
            yield GaugeMetricFamily("splitft_checkpoint_folder_bytes", "What the checkpoint folder holds "
                                    "(--checkpoint-max-mb bounds it).", value=server.checkpoints.nbytes())

    def _ranks(self) -> Iterator[Metric]:
        group = getattr(self.server, "group", None)
        if group is None:
            return
        family = GaugeMetricFamily("splitft_rank_up", "1 while a rank of this cloud serves (its heartbeat moves); "
                                   "the front door (rank 0) sees every rank, another rank itself.",
                                   labels=("rank",))
        ranks = range(group.world_size) if group.rank == 0 else (group.rank,)
        for rank in ranks:
            family.add_metric((str(rank),), 1.0 if group.live(rank) else 0.0)
        yield family


def _labelled(cls: Any, name: str, text: str, label: str, values: dict[str, Any]) -> Metric:
    family = cls(name, text, labels=(label,))
    for key, value in sorted(values.items()):
        family.add_metric((key,), value)
    return family


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), or None where /proc does not say."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Endpoint:
    """Metrics served over HTTP at ``http://HOST:PORT/metrics`` until :meth:`close`; a server's
    once :meth:`watch` is given it (the port is taken first, so a port in use is refused before
    the cloud starts)."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        if not available():
            raise ConfigError("--metrics-port serves Prometheus metrics through the prometheus_client package: "
                              "install the 'metrics' extra (pip install 'splitft[metrics]')")
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry(auto_describe=True)
        try:
            self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from None
        self.host, self.port = host, int(self._http.server_address[1])

    def watch(self, server: Any) -> Watch:
        """Count what ``server`` does from now on, and serve it here."""
        counts = watch(server)
        self.registry.register(CloudCollector(server, counts))
        return counts

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


__all__ = ["NAMES", "CloudCollector", "Endpoint", "available", "resident_bytes"]
