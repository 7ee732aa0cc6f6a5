"""Prometheus metrics of the manager (``drbalance-manager --metrics-port PORT``).

The series (every name starts with ``drbalance_``; docs/operations.md explains each):

- ``drbalance_apps`` (gauge): live apps in the manager's table.
- ``drbalance_app_slowdown{app}`` (gauge): the app's slow-down SD (predicted finish / solo time).
- ``drbalance_app_slowdown_estimated{app}`` (gauge): 1 when the app's SD divides by its own online
  estimate of its solo-run time (the job was given none), 0 when by a given or profiled one.
- ``drbalance_app_dr_share_ratio{app,gpu}`` (gauge): the fraction of the app's mini-batch on that
  GPU (its DR share / DR total), in the manager's GPU order.
- ``drbalance_app_iteration_seconds{app}`` (gauge): the app's mean iteration time, seconds.
- ``drbalance_decisions_total{policy,branch}`` (counter): DR decisions by the policy branch taken.
- ``drbalance_exchange_latency_seconds`` (histogram): from an app's notice (its send time) to the
  manager's answer, seconds.
- ``drbalance_gpu_utilization_ratio{gpu}`` (gauge): smoothed utilisation (0-1), as the policy sees it.
- ``drbalance_gpu_memory_used_bytes{gpu}`` / ``drbalance_gpu_memory_total_bytes{gpu}`` (gauges).
- ``drbalance_manager_info{version,namespace,policy}`` (gauge, always 1).

Per-app and per-GPU series come from a :class:`MetricsSnapshot` that the manager's loop builds
and swaps in whole (one reference assignment): a scrape, served from another thread, sees one
consistent state, and an app that left is simply not in the next snapshot. Readings that are
unknown (an SD before the first iteration time, a GPU NVML could not read) are left out, never
exported as NaN. The registry belongs to the :class:`ManagerMetrics` object; nothing is
registered in ``prometheus_client``'s global default registry.
"""

from __future__ import annotations

import errno
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from drbalance import __version__
from drbalance.manager.nvml import MemoryInfo

IDLE_CONNECTION_SECONDS = 10.0
"""A connection to the metrics endpoint that sends no request for this long is closed. The server
runs a thread per connection: without a limit, idle connections that any local user can open
(1,000 of them made 127 threads in 18 s) would hold threads, which count against the manager's
user's process limit, for ever."""

MAX_CONNECTIONS = 16
"""Connections served at once; one more is closed as soon as it is accepted. A client that sends
a byte now and then is never idle: without a limit, 40 of them held 40 threads."""

CONNECTION_SECONDS = 30.0
"""A connection still open this long after it was accepted is closed, however it trickles bytes
(a scrape takes milliseconds; the server answers one request per connection)."""

EXCHANGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram buckets of the exchange latency, seconds: sub-millisecond (an idle manager) to the
clients' exchange timeout range (a flooded or stalled one)."""


PORT_HINT = "choose another --metrics-port, or 0 for any free one"
ADDRESS_HINT = "check --metrics-address: an address of this host, e.g. 127.0.0.1, 0.0.0.0 or ::"


class MetricsServerError(RuntimeError):
    """The metrics endpoint cannot be served (the text says where and why; ``hint`` what to change)."""

    def __init__(self, message: str, hint: str = PORT_HINT) -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class AppMetrics:
    """One app as the metrics show it. ``shares``: fraction of the mini-batch per manager GPU
    (empty when the app's devices cannot be placed among the manager's GPUs)."""

    name: str
    slowdown: float | None
    iteration_seconds: float | None
    shares: tuple[float, ...] = ()
    slowdown_estimated: bool = False


@dataclass(frozen=True)
class MetricsSnapshot:
    """The manager's state for one scrape: apps, smoothed utilisation (percent, None = unknown)
    and memory per GPU (None = unknown)."""

    apps: tuple[AppMetrics, ...] = ()
    utilization: tuple[float | None, ...] = ()
    memory: tuple[MemoryInfo | None, ...] = ()


class _StateCollector(Collector):
    """Yields the gauges of the current snapshot (a custom collector: label sets follow the snapshot)."""

    def __init__(self, namespace: str, policy: str) -> None:
        self.namespace = namespace
        self.policy = policy
        self.snapshot = MetricsSnapshot()

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot  # one read: the loop may swap in a new one meanwhile
        info = GaugeMetricFamily("drbalance_manager_info", "The manager: version, namespace and policy (always 1)",
                                 labels=("version", "namespace", "policy"))
        info.add_metric((__version__, self.namespace, self.policy), 1.0)
        yield info
        yield GaugeMetricFamily("drbalance_apps", "Live apps in the manager's table", value=len(snapshot.apps))
        slowdown = GaugeMetricFamily("drbalance_app_slowdown",
                                     "The app's slow-down SD: predicted finish time / solo-run time", labels=("app",))
        iteration = GaugeMetricFamily("drbalance_app_iteration_seconds",
                                      "The app's mean iteration time in its current window, seconds", labels=("app",))
        shares = GaugeMetricFamily("drbalance_app_dr_share_ratio",
                                   "Fraction of the app's mini-batch on the GPU (DR share / DR total)",
                                   labels=("app", "gpu"))
        estimated = GaugeMetricFamily("drbalance_app_slowdown_estimated",
                                      "1 when the app's SD uses its own online estimate of its solo-run time",
                                      labels=("app",))
        for app in snapshot.apps:
            estimated.add_metric((app.name,), float(app.slowdown_estimated))
            if app.slowdown is not None:
                slowdown.add_metric((app.name,), app.slowdown)
            if app.iteration_seconds is not None:
                iteration.add_metric((app.name,), app.iteration_seconds)
            for gpu, share in enumerate(app.shares):
                shares.add_metric((app.name, str(gpu)), share)
        yield from (slowdown, estimated, iteration, shares)
        utilization = GaugeMetricFamily("drbalance_gpu_utilization_ratio",
                                        "Smoothed GPU utilisation (fraction of time busy, 0-1) as the policy sees it",
                                        labels=("gpu",))
        for gpu, percent in enumerate(snapshot.utilization):
            if percent is not None:
                utilization.add_metric((str(gpu),), percent / 100.0)
        used = GaugeMetricFamily("drbalance_gpu_memory_used_bytes", "GPU memory in use, bytes", labels=("gpu",))
        total = GaugeMetricFamily("drbalance_gpu_memory_total_bytes", "GPU memory in all, bytes", labels=("gpu",))
        for gpu, memory in enumerate(snapshot.memory):
            if memory is not None:
                used.add_metric((str(gpu),), memory.used)
                total.add_metric((str(gpu),), memory.total)
        yield from (utilization, used, total)


class ManagerMetrics:
    """The manager's metrics: its own registry, the hooks the daemon calls, and the HTTP endpoint.

    Hooks (called from the manager's loop): :meth:`decision`, :meth:`exchange`, :meth:`update`.
    """

    def __init__(self, namespace: str, policy: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._state = _StateCollector(namespace, policy)
        self.registry.register(self._state)
        self._decisions = Counter("drbalance_decisions", "DR decisions, by the policy branch taken",
                                  labelnames=("policy", "branch"), registry=self.registry)
        self._exchange = Histogram("drbalance_exchange_latency_seconds",
                                   "From an app's notice (its send time) to the manager's answer, seconds",
                                   buckets=EXCHANGE_BUCKETS, registry=self.registry)
        self._server = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None

    # --- hooks -------------------------------------------------------------------------------
    def decision(self, policy: str, branch: str) -> None:
        self._decisions.labels(policy=policy, branch=branch).inc()

    def exchange(self, seconds: float) -> None:
        """One exchange's latency; a negative value (clocks stepped) counts as 0."""
        self._exchange.observe(max(0.0, seconds))

    def update(self, snapshot: MetricsSnapshot) -> None:
        self._state.snapshot = snapshot

    @property
    def snapshot(self) -> MetricsSnapshot:
        return self._state.snapshot

    # --- the endpoint ------------------------------------------------------------------------
    def serve(self, address: str, port: int) -> tuple[str, int]:
        """Serve ``/metrics`` on ``address:port`` (port 0: any free one) in a daemon thread.

        Returns the bound (address, port). ``MetricsServerError`` when it cannot be bound.
        """
        if not 0 <= port <= 65535:
            raise MetricsServerError(f"metrics port {port} is not in 0..65535")
        try:
            server, thread = start_http_server(port, addr=address, registry=self.registry)
        except OSError as error:
            reason = error.strerror or str(error)
            port_fault = not isinstance(error, socket.gaierror) and error.errno in (errno.EADDRINUSE, errno.EACCES)
            raise MetricsServerError(f"cannot serve metrics on {_host(address)}:{port}: {reason}",
                                     PORT_HINT if port_fault else ADDRESS_HINT) from None
        except ValueError as error:  # e.g. UnicodeError from the resolver: '127.0.0..1', a 64-character label
            raise MetricsServerError(f"cannot serve metrics on {_host(address)}:{port}: not a host name or "
                                     f"address ({error})", ADDRESS_HINT) from None
        _close_idle_connections(server)
        _limit_connections(server)
        self._server, self._thread = server, thread
        self.address = (address, server.server_address[1])
        return self.address

    def url(self) -> str | None:
        if self.address is None:
            return None
        return f"http://{_host(self.address[0])}:{self.address[1]}/metrics"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _close_idle_connections(server: Any) -> None:
    """Give every connection of ``server`` (a socketserver) a socket timeout of
    ``IDLE_CONNECTION_SECONDS``, and drop the timed-out ones without the traceback socketserver
    would print to the manager's stderr for each."""
    handler = server.RequestHandlerClass
    server.RequestHandlerClass = type("IdleClosingHandler", (handler,), {"timeout": IDLE_CONNECTION_SECONDS})
    report = server.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a timeout, a client gone or closed by _limit_connections
            report(request, client_address)

    server.handle_error = handle_error


def _limit_connections(server: Any) -> None:
    """Serve at most ``MAX_CONNECTIONS`` connections of ``server`` (a threading socketserver) at
    once, closing any more at once, and shut down any still open ``CONNECTION_SECONDS`` after it
    was accepted (checked by the server's loop every half second: no thread of its own)."""
    lock = threading.Lock()
    accepted: dict[Any, float] = {}  # open connection -> monotonic time it was accepted
    process_request, process_request_thread = server.process_request, server.process_request_thread
    service_actions = server.service_actions

    def limited_process_request(request: Any, client_address: Any) -> None:
        with lock:
            full = len(accepted) >= MAX_CONNECTIONS
            if not full:
                accepted[request] = time.monotonic()
        if full:
            server.shutdown_request(request)
            return
        try:
            process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            with lock:
                accepted.pop(request, None)
            raise

    def tracked_process_request_thread(request: Any, client_address: Any) -> None:
        try:
            process_request_thread(request, client_address)
        finally:
            with lock:
                accepted.pop(request, None)

    def close_overdue() -> None:
        service_actions()
        now = time.monotonic()
        with lock:
            overdue = [request for request, since in accepted.items() if now - since > CONNECTION_SECONDS]
        for request in overdue:
            try:
                request.shutdown(socket.SHUT_RDWR)  # its thread's read or write ends at once
            except OSError:  # closed meanwhile by its thread
                pass

    server.process_request = limited_process_request
    server.process_request_thread = tracked_process_request_thread
    server.service_actions = close_overdue
