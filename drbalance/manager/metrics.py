"""Prometheus metrics of the manager (``drbalance-manager --metrics-port PORT``).

The series (every name starts with ``drbalance_``; docs/operations.md explains each):

- ``drbalance_apps`` (gauge): live apps in the manager's table.
- ``drbalance_app_slowdown{app}`` (gauge): the app's slow-down SD (predicted finish / solo time).
- ``drbalance_app_slowdown_lower_bound{app}`` (gauge): in its place while the app's own estimate of
  its solo-run time can still only be too high: the SD is at least this (``drbalance.solo_estimate``).
- ``drbalance_app_slowdown_estimated{app}`` (gauge): 1 when the app's SD divides by its own online
  estimate of its solo-run time (the job was given none), 0 when by a given or profiled one.
- ``drbalance_app_slowdown_manager_estimate{app}`` (gauge): 1 when that estimate is the manager's
  (the job had no GPU alone; ``AppCommand.solo_iteration``), else 0.
- ``drbalance_app_dr_share_ratio{app,gpu}`` (gauge): the fraction of the app's mini-batch on that
  GPU (its DR share / DR total), in the manager's GPU order.
- ``drbalance_app_iteration_seconds{app}`` (gauge): the app's mean iteration time, seconds.
- ``drbalance_decisions_total{policy,branch}`` (counter): DR decisions by the policy branch taken.
- ``drbalance_exchange_latency_seconds`` (histogram): from an app's notice (its send time) to the
  manager's answer, seconds; a latency outside 0..``MAX_EXCHANGE_LATENCY`` (a send time that
  cannot be right) is not observed but counted in ``drbalance_exchange_latency_dropped_total``.
- ``drbalance_gpu_utilization_ratio{gpu}`` (gauge): smoothed utilisation (0-1), as the policy sees it.
- ``drbalance_gpu_memory_used_bytes{gpu}`` / ``drbalance_gpu_memory_total_bytes{gpu}`` (gauges).
- ``drbalance_manager_info{version,namespace,policy}`` (gauge, always 1).

Per-app and per-GPU series come from a :class:`MetricsSnapshot` that the manager's loop builds
and swaps in whole (one reference assignment): a scrape, served from another thread, sees one
consistent state, and an app that left is simply not in the next snapshot. The endpoint is an
asyncio server in a thread of its own that answers with prometheus-client's WSGI application. Readings that are
unknown (an SD before the first iteration time, a GPU NVML could not read) are left out, never
exported as NaN. The registry belongs to the :class:`ManagerMetrics` object; nothing is
registered in ``prometheus_client``'s global default registry.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import io
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from drbalance import __version__
from drbalance.manager.nvml import MemoryInfo

REQUEST_SECONDS = 5.0
"""A connection to the metrics endpoint must deliver its whole request (line and headers) within
this many seconds of being accepted, and take the answer within as long again, or it is closed
(a scrape takes milliseconds). An idle or trickling connection costs a file descriptor for that
long, never a thread."""

MAX_OPEN_CONNECTIONS = 64
"""Connections open at once. One more makes room by closing the oldest that has not delivered its
request yet, so connections that any local user holds open (each a descriptor of the manager's,
1,024 by default) cannot keep a scrape from being answered."""

MAX_REQUEST_BYTES = 8192
"""The most a request's line and headers may take; a longer request is closed."""

EXCHANGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram buckets of the exchange latency, seconds: sub-millisecond (an idle manager) to the
clients' exchange timeout range (a flooded or stalled one)."""

MAX_EXCHANGE_LATENCY = 60.0
"""Seconds: the longest exchange latency observed. The latency is the manager's wall clock at its
answer minus the send time the notice carries, both from this host's clock; a notice does not wait
that long in an answering manager's inbox of 10, so a latency above this, or below 0, comes from a
send time that cannot be right (a notice written by hand, a clock step) and is dropped and counted:
one notice with a send time of -1e300 would otherwise set the histogram's sum to 1e+300 for the
manager's life."""


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
    slowdown_from_manager: bool = False
    slowdown_bound: bool = False  # ``slowdown`` is a lower bound, not the SD


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
        lower = GaugeMetricFamily("drbalance_app_slowdown_lower_bound",
                                  "In place of the SD while the app's own estimate of its solo-run time can still "
                                  "only be too high: the SD is at least this", labels=("app",))
        estimated = GaugeMetricFamily("drbalance_app_slowdown_estimated",
                                      "1 when the app's SD uses its own online estimate of its solo-run time",
                                      labels=("app",))
        from_manager = GaugeMetricFamily("drbalance_app_slowdown_manager_estimate",
                                         "1 when the app's SD uses the manager's estimate of its solo-run time",
                                         labels=("app",))
        for app in snapshot.apps:
            estimated.add_metric((app.name,), float(app.slowdown_estimated))
            from_manager.add_metric((app.name,), float(app.slowdown_from_manager))
            if app.slowdown is not None:
                (lower if app.slowdown_bound else slowdown).add_metric((app.name,), app.slowdown)
            if app.iteration_seconds is not None:
                iteration.add_metric((app.name,), app.iteration_seconds)
            for gpu, share in enumerate(app.shares):
                shares.add_metric((app.name, str(gpu)), share)
        yield from (slowdown, lower, estimated, from_manager, iteration, shares)
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
        self._dropped = Counter("drbalance_exchange_latency_dropped",
                                f"Exchanges whose latency (from the notice's send time) was outside 0.."
                                f"{MAX_EXCHANGE_LATENCY:g} s: not observed", registry=self.registry)
        self._endpoint: _Endpoint | None = None
        self.address: tuple[str, int] | None = None

    # --- hooks -------------------------------------------------------------------------------
    def decision(self, policy: str, branch: str) -> None:
        self._decisions.labels(policy=policy, branch=branch).inc()

    def exchange(self, seconds: float) -> None:
        """One exchange's latency; one outside 0..``MAX_EXCHANGE_LATENCY`` (or NaN) is dropped and counted."""
        if 0.0 <= seconds <= MAX_EXCHANGE_LATENCY:
            self._exchange.observe(seconds)
        else:
            self._dropped.inc()

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
            endpoint = _Endpoint(self.registry, address, port)
        except OSError as error:
            reason = error.strerror or str(error)
            port_fault = not isinstance(error, socket.gaierror) and error.errno in (errno.EADDRINUSE, errno.EACCES)
            raise MetricsServerError(f"cannot serve metrics on {_host(address)}:{port}: {reason}",
                                     PORT_HINT if port_fault else ADDRESS_HINT) from None
        except ValueError as error:  # e.g. UnicodeError from the resolver: '127.0.0..1', a 64-character label
            raise MetricsServerError(f"cannot serve metrics on {_host(address)}:{port}: not a host name or "
                                     f"address ({error})", ADDRESS_HINT) from None
        self._endpoint = endpoint
        self.address = (address, endpoint.port)
        return self.address

    def url(self) -> str | None:
        if self.address is None:
            return None
        return f"http://{_host(self.address[0])}:{self.address[1]}/metrics"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.close()


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class _Endpoint:
    """``/metrics`` (prometheus-client's WSGI application) served by an asyncio server running in a
    daemon thread of its own. A connection costs a descriptor, not a thread, while it waits for
    its request: connections held open by anyone cannot keep a scrape waiting (see
    ``REQUEST_SECONDS`` and ``MAX_OPEN_CONNECTIONS``). One request per connection."""

    def __init__(self, registry: CollectorRegistry, address: str, port: int) -> None:
        self._app = make_wsgi_app(registry)
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # open and still waiting for a request, oldest first
        self._open: set[asyncio.StreamWriter] = set()  # open, less those closed to make room
        self._tasks: set[asyncio.Task] = set()  # one per connection, until it has ended
        self._loop = asyncio.new_event_loop()
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, address, port, limit=MAX_REQUEST_BYTES))
        except BaseException:
            self._loop.close()
            raise
        self._thread = threading.Thread(target=self._loop.run_forever, name="drbalance-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._make_room()
        self._waiting[writer] = None
        self._open.add(writer)
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_SECONDS)
            self._waiting.pop(writer, None)
            writer.write(self._answer(head))
            await asyncio.wait_for(writer.drain(), REQUEST_SECONDS)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # idle, too slow, cut off, too long or closed to make room: closed, nothing to report
        finally:
            self._waiting.pop(writer, None)
            self._open.discard(writer)
            self._tasks.discard(task)
            writer.transport.abort()

    def _make_room(self) -> None:
        """Close the oldest connections still waiting for their request while ``MAX_OPEN_CONNECTIONS``
        are open (those being answered finish within ``REQUEST_SECONDS``)."""
        while len(self._open) >= MAX_OPEN_CONNECTIONS and self._waiting:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            self._open.discard(oldest)
            oldest.transport.abort()  # its reader ends at its next turn

    def _answer(self, head: bytes) -> bytes:
        """The HTTP response to a request's line and headers, from prometheus-client's application."""
        line, _, rest = head.partition(b"\r\n")
        parts = line.decode("latin-1").split()
        try:
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                raise ValueError("not an HTTP request line")
            headers = http.client.parse_headers(io.BytesIO(rest))
        except (ValueError, http.client.HTTPException):
            return _response("400 Bad Request", [("Content-Type", "text/plain")], b"bad request\n")
        target = urllib.parse.urlsplit(parts[1])
        environ = {"REQUEST_METHOD": parts[0], "PATH_INFO": urllib.parse.unquote(target.path),
                   "QUERY_STRING": target.query, "HTTP_ACCEPT": headers.get("Accept"),
                   "HTTP_ACCEPT_ENCODING": headers.get("Accept-Encoding")}
        replied: dict[str, Any] = {}

        def start_response(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            replied["status"], replied["headers"] = status, response_headers

        body = b"".join(self._app(environ, start_response))
        return _response(replied["status"], replied["headers"], body)

    def close(self) -> None:
        """Stop listening, close every connection, end the thread."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._shut_down(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _shut_down(self) -> None:
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


def _response(status: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{name}: {value}" for name, value in headers),
             f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body
