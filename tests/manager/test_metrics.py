"""Prometheus metrics: the collector with hand-written snapshots, and a real manager scraped over loopback."""

from __future__ import annotations

import json
import math
import re
import select
import socket
import threading
import time
import urllib.request

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from drbalance.cli import main as drbalance
from drbalance.manager.cli import main as manager_main
from drbalance.manager.metrics import AppMetrics, ManagerMetrics, MetricsServerError, MetricsSnapshot
from drbalance.manager.nvml import MemoryInfo
from tests.conftest import leftovers, python_process, wait_for
from tests.helpers.connections import HeldConnections
from tests.helpers.processes import ManagerProcess, drain, first_line, stop_app, toy_app

GIB = 1024 ** 3
TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} (INFO|WARNING|ERROR|DEBUG) ")  # every manager line


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample name + sorted labels -> value, from the text exposition format."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def named(found: dict, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (sample, labels), value in found.items() if sample == name}


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return samples(response.read().decode("utf-8"))


def scrape_until(url: str, predicate, timeout: float) -> dict:
    """Scrape until ``predicate(samples)`` holds (generous ``timeout``: a busy machine); the samples."""
    last: dict = {}

    def check():
        last["found"] = scrape(url)
        return predicate(last["found"])

    wait_for(check, timeout=timeout, interval=0.2)
    return last["found"]


def test_the_collector_shows_a_snapshot_and_leaves_out_unknown_readings():
    metrics = ManagerMetrics("ns1", "fair")
    metrics.update(MetricsSnapshot(
        apps=(AppMetrics("a", 1.25, 0.5, (0.75, 0.25)),
              AppMetrics("b", None, None, (), slowdown_estimated=True, slowdown_from_manager=True),
              AppMetrics("c", 0.4, 0.1, (), slowdown_estimated=True, slowdown_bound=True)),
        utilization=(40.0, None),
        memory=(MemoryInfo(16 * GIB, 4 * GIB, 12 * GIB), None),
    ))
    metrics.decision("fair", "move")
    metrics.decision("fair", "move")
    metrics.decision("fair", "keep")
    metrics.exchange(0.003)
    metrics.exchange(-1.0)  # a clock step, or a send time written by hand: dropped, never a negative sum
    found = samples(prometheus_client.generate_latest(metrics.registry).decode())
    assert named(found, "drbalance_apps") == {(): 3}
    # b's SD is unknown: no sample; c's is only a lower bound: in its own series, not as an SD
    assert named(found, "drbalance_app_slowdown") == {(("app", "a"),): 1.25}
    assert named(found, "drbalance_app_slowdown_lower_bound") == {(("app", "c"),): 0.4}
    assert named(found, "drbalance_app_slowdown_estimated") == {(("app", "a"),): 0.0, (("app", "b"),): 1.0,
                                                                (("app", "c"),): 1.0}
    assert named(found, "drbalance_app_slowdown_manager_estimate") == {(("app", "a"),): 0.0, (("app", "b"),): 1.0,
                                                                       (("app", "c"),): 0.0}
    assert named(found, "drbalance_app_iteration_seconds") == {(("app", "a"),): 0.5, (("app", "c"),): 0.1}
    assert named(found, "drbalance_app_dr_share_ratio") == {(("app", "a"), ("gpu", "0")): 0.75,
                                                            (("app", "a"), ("gpu", "1")): 0.25}
    assert named(found, "drbalance_gpu_utilization_ratio") == {(("gpu", "0"),): 0.4}
    assert named(found, "drbalance_gpu_memory_used_bytes") == {(("gpu", "0"),): 4 * GIB}
    assert named(found, "drbalance_gpu_memory_total_bytes") == {(("gpu", "0"),): 16 * GIB}
    assert named(found, "drbalance_decisions_total") == {(("branch", "keep"), ("policy", "fair")): 1,
                                                         (("branch", "move"), ("policy", "fair")): 2}
    assert named(found, "drbalance_exchange_latency_seconds_count") == {(): 1}
    assert named(found, "drbalance_exchange_latency_seconds_sum") == {(): pytest.approx(0.003)}
    assert named(found, "drbalance_exchange_latency_dropped_total") == {(): 1}
    assert named(found, "drbalance_manager_info")[(("namespace", "ns1"), ("policy", "fair"),
                                                   ("version", __import__("drbalance").__version__))] == 1
    # a newer snapshot without app a: its series are gone
    metrics.update(MetricsSnapshot(apps=(AppMetrics("b", 2.0, 0.1, (1.0, 0.0)),), utilization=(50.0, 60.0)))
    found = samples(prometheus_client.generate_latest(metrics.registry).decode())
    assert set(named(found, "drbalance_app_slowdown")) == {(("app", "b"),)}
    assert {labels[0] for labels in named(found, "drbalance_app_dr_share_ratio")} == {("app", "b")}
    assert named(found, "drbalance_gpu_memory_used_bytes") == {}


def test_metrics_live_in_their_own_registry_not_the_global_default():
    ManagerMetrics("ns2", "paper").decision("paper", "sd")
    global_names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(name.startswith("drbalance") for name in global_names)


def test_a_taken_port_is_a_clear_error_not_a_traceback():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        metrics = ManagerMetrics("ns3", "fair")
        with pytest.raises(MetricsServerError, match=f"cannot serve metrics on 127.0.0.1:{port}: .*in use") as taken:
            metrics.serve("127.0.0.1", port)
    assert "--metrics-port" in taken.value.hint
    for address in ("999.1.1.1", "192.0.2.1"):  # not an address at all; an address of no interface here
        with pytest.raises(MetricsServerError, match=f"cannot serve metrics on {address}:0") as wrong:
            ManagerMetrics("ns3", "fair").serve(address, 0)
        assert "--metrics-address" in wrong.value.hint and "--metrics-port" not in wrong.value.hint, address
    with pytest.raises(SystemExit) as exit_info:
        manager_main(["--metrics-port", "70000"])
    assert exit_info.value.code == 2  # argparse: "a port is a number 0..65535"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_manager_serves_a_running_apps_series_over_loopback_and_drops_them_when_it_ends(ipc_env, tmp_path):
    script = tmp_path / "gpus.json"
    script.write_text(json.dumps({
        "gpus": 4, "memory_total": [16 * GIB] * 4,
        "steps": [{"at": 0, "util": [90, 80, 20, 50], "free": [12 * GIB, 8 * GIB, 16 * GIB, 1 * GIB]}],
    }))
    manager = ManagerProcess(tmp_path, ipc_env, (0, 0, 0, 0), "--source", f"scripted:{script}",
                             "--metrics-port", "0")
    app = None
    try:
        status = json.loads(ipc_env.manager_status().read_text())
        url = status["metrics"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")  # loopback by default
        app = toy_app("metered", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05")
        first_line(app)
        drain(app)  # it prints a line per iteration: a full pipe would block it
        found = scrape_until(url, lambda f: named(f, "drbalance_app_slowdown"), timeout=90)
        assert named(found, "drbalance_apps") == {(): 1}
        slowdown = named(found, "drbalance_app_slowdown")[(("app", "metered"),)]
        assert math.isfinite(slowdown) and slowdown > 0
        iteration = named(found, "drbalance_app_iteration_seconds")[(("app", "metered"),)]
        assert 0.05 <= iteration < 30  # each toy iteration sleeps 0.05 s
        shares = named(found, "drbalance_app_dr_share_ratio")
        assert {dict(labels)["gpu"] for labels in shares} == {"0", "1", "2", "3"}
        assert sum(shares.values()) == pytest.approx(1.0)
        assert shares[(("app", "metered"), ("gpu", "2"))] == 1.0  # the paper's exclusive placement on 20 %
        decisions = named(found, "drbalance_decisions_total")
        assert decisions[(("branch", "exclusive"), ("policy", "paper"))] >= 1
        assert named(found, "drbalance_exchange_latency_seconds_count")[()] >= 1
        assert named(found, "drbalance_exchange_latency_seconds_sum")[()] >= 0
        assert named(found, "drbalance_gpu_utilization_ratio") == {
            (("gpu", "0"),): 0.9, (("gpu", "1"),): 0.8, (("gpu", "2"),): 0.2, (("gpu", "3"),): 0.5}
        assert named(found, "drbalance_gpu_memory_used_bytes") == {
            (("gpu", "0"),): 4 * GIB, (("gpu", "1"),): 8 * GIB, (("gpu", "2"),): 0, (("gpu", "3"),): 15 * GIB}
        assert set(named(found, "drbalance_gpu_memory_total_bytes").values()) == {16 * GIB}

        stop_app(app)
        gone = scrape_until(url, lambda f: named(f, "drbalance_apps") == {(): 0}, timeout=60)
        assert named(gone, "drbalance_app_slowdown") == {}
        assert named(gone, "drbalance_app_dr_share_ratio") == {}
        assert named(gone, "drbalance_app_iteration_seconds") == {}
        assert named(gone, "drbalance_decisions_total")  # counters stay: they count what happened
    finally:
        if app is not None and app.poll() is None:
            app.kill()
            app.wait()
        code, err = manager.stop()
    assert code == 0, err
    assert "metrics at http://127.0.0.1:" in err
    assert [e["url"] for e in manager.events("metrics")] == [url]
    assert leftovers(ipc_env) == []


def test_a_manager_whose_metrics_port_is_taken_exits_with_a_clear_error(ipc_env, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        manager = ManagerProcess(tmp_path, ipc_env, (10, 20, 30, 40), "--metrics-port", str(port), wait=False)
        code, err = manager.stop(signal_it=False)
    assert code == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in err and "--metrics-port" in err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all(TIMESTAMPED.match(line) for line in lines), lines  # errors too: time and level
    assert not ipc_env.manager_status().exists()
    assert leftovers(ipc_env) == []


@pytest.mark.timeout(60)
def test_an_address_the_resolver_cannot_even_encode_is_a_clear_error_not_a_traceback(ipc_env, caplog):
    """A typo like '127.0.0..1' (an empty label) or a label over 63 characters makes getaddrinfo
    raise UnicodeError (a ValueError), not OSError: it must not end the manager with a traceback."""
    for address in ("127.0.0..1", "a" * 64):
        with pytest.raises(MetricsServerError, match="cannot serve metrics on .*not a host name or address") as bad:
            ManagerMetrics("ns4", "fair").serve(address, 0)
        assert "--metrics-address" in bad.value.hint, address
    assert manager_main(["--source", "emulated:1", "--metrics-port", "0", "--metrics-address", "127.0.0..1",
                         "--duration", "5"]) == 1
    assert "not a host name or address" in caplog.text and "--metrics-address" in caplog.text
    assert leftovers(ipc_env) == []


@pytest.mark.timeout(60)
def test_an_idle_connection_to_the_metrics_port_is_closed_and_scrapes_go_on(monkeypatch, capfd):
    """Any local user can connect and send nothing: each connection held a server thread for ever."""
    from drbalance.manager import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "REQUEST_SECONDS", 0.5)
    server = ManagerMetrics("ns5", "fair")
    host, port = server.serve("127.0.0.1", 0)
    try:
        idle = socket.create_connection((host, port), timeout=30)
        idle.settimeout(30)
        assert idle.recv(1) == b""  # closed by the server, not waiting for a request for ever
        idle.close()
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as reply:
            assert reply.status == 200 and b"drbalance" in reply.read()
    finally:
        server.close()
    assert "Traceback" not in capfd.readouterr().err  # a timed-out connection is not an error to print


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_connections_that_trickle_bytes_hold_no_thread_and_are_closed_oldest_first(monkeypatch, capfd):
    """A client that sends a header line now and then is never idle. Such a connection holds no
    server thread (one held for as long as it went on would, at the server's thread limit, close
    scrapes), is closed ``REQUEST_SECONDS`` after it was accepted however it trickles, and past
    ``MAX_OPEN_CONNECTIONS`` the oldest waiting one is closed to make room."""
    from drbalance.manager import metrics as metrics_module

    # a limit far from the 0.2 s between the test's header lines, so a test process stalled on a
    # loaded machine for a second does not change the outcome
    monkeypatch.setattr(metrics_module, "REQUEST_SECONDS", 6.0)
    monkeypatch.setattr(metrics_module, "MAX_OPEN_CONNECTIONS", 4)
    server = ManagerMetrics("ns6", "fair")
    host, port = server.serve("127.0.0.1", 0)
    threads_before = threading.active_count()
    connections = []

    def connect() -> socket.socket:
        connection = socket.create_connection((host, port), timeout=30)
        connection.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a request with no end yet
        connections.append(connection)
        time.sleep(0.05)
        return connection

    def trickle(sockets: list[socket.socket], seconds: float) -> dict[socket.socket, float]:
        """A header line on each open socket every 0.2 s for ``seconds`` (or until all are closed):
        {socket: seconds until it was closed}."""
        started = time.monotonic()
        closed: dict[socket.socket, float] = {}
        while time.monotonic() - started < seconds and len(closed) < len(sockets):
            for connection in sockets:
                if connection in closed:
                    continue
                readable, _, _ = select.select([connection], [], [], 0)
                try:
                    if readable and connection.recv(1) == b"":
                        raise ConnectionResetError("closed")
                    connection.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    closed[connection] = time.monotonic() - started
            time.sleep(0.2)
        return closed

    try:
        first = [connect() for _ in range(4)]
        newest = connect()
        closed = trickle([*first, newest], 2.0)
        assert set(closed) == {first[0]}  # room made for the fifth: the oldest waiting one closed
        assert threading.active_count() == threads_before  # no thread per connection
        closed = trickle([*first[1:], newest], 20.0)
        assert set(closed) == {*first[1:], newest}  # closed after REQUEST_SECONDS, however they trickle
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as reply:
            assert reply.status == 200 and b"drbalance" in reply.read()
    finally:
        for connection in connections:
            connection.close()
        server.close()
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_a_job_without_a_solo_time_shows_its_sd_as_estimated_in_status_and_metrics(ipc_env, tmp_path, capsys):
    """A job given no solo time estimates it; the record says so, and the manager's status file,
    ``drbalance status`` and the metrics mark its SD as estimated (the other job's not). This one
    trains on the CPU, which cannot tell whether it had its device alone: its estimate can only be
    too high, and its SD is shown as the lower bound it is (``>=``), never as the SD."""
    manager = ManagerProcess(tmp_path, ipc_env, (0, 0, 0, 0), "--metrics-port", "0")
    apps = []
    try:
        url = json.loads(ipc_env.manager_status().read_text())["metrics"]
        for name, solo in (("guessing", "estimate"), ("given", "30")):
            app = toy_app(name, "--epochs", "100000", "--iterations", "3", "--sleep", "0.05", "--solo", solo)
            first_line(app)
            drain(app)
            apps.append(app)
        found = scrape_until(url, lambda f: named(f, "drbalance_app_slowdown_lower_bound")
                             and named(f, "drbalance_app_slowdown"), timeout=90)
        assert named(found, "drbalance_app_slowdown_estimated") == {(("app", "guessing"),): 1.0,
                                                                    (("app", "given"),): 0.0}
        assert set(named(found, "drbalance_app_slowdown")) == {(("app", "given"),)}
        assert set(named(found, "drbalance_app_slowdown_lower_bound")) == {(("app", "guessing"),)}
        status = {app["name"]: app for app in json.loads(ipc_env.manager_status().read_text())["apps"]}
        assert status["guessing"]["sd_estimated"] is True and status["given"]["sd_estimated"] is False
        assert status["guessing"]["sd_bound"] is True and status["given"]["sd_bound"] is False
        assert drbalance(["status"]) == 0
        rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.split()}
        assert rows["guessing"][4].startswith(">=") and not rows["given"][4].startswith((">=", "~"))
        assert ">=" in rows and "estimate of its solo-run time can still only be too high" in " ".join(rows[">="])
    finally:
        for app in apps:
            stop_app(app)
        code, err = manager.stop()
    assert code == 0, err


@pytest.mark.timeout(120)
def test_a_notice_with_an_absurd_send_time_leaves_the_latency_metric_as_it_was(ipc_env, tmp_path):
    """The latency is the manager's answer time minus the send time a notice carries. Absurd send
    times are dropped and counted: one well-formed notice sent at -1e300 would set the histogram's
    sum to 1e+300 for the manager's life, and one from the future would record a negative latency."""
    from drbalance.ipc import discovery, objects
    from drbalance.ipc.layout import Notice, NoticeKind

    manager = ManagerProcess(tmp_path, ipc_env, (10, 20, 30, 40), "--metrics-port", "0")
    job = python_process("tests.helpers.idle_app", "sender")  # publishes once, then sits still
    try:
        assert job.stdout.readline().startswith("ready ")
        url = json.loads(ipc_env.manager_status().read_text())["metrics"]
        inbox = objects.open_queue(ipc_env.inbox(discovery.read_manager(ipc_env).inbox))
        try:  # what any process of the job's user can send in its name
            for seq, sent in enumerate((-1e300, 1e300, time.time()), start=1):
                inbox.send(Notice(NoticeKind.BOUNDARY, job.pid, seq, "sender", sent).encode(), timeout=10)
        finally:
            inbox.close()
        wait_for(lambda: len([e for e in manager.events("decision") if e["app"] == "sender"]) >= 3)
        found = scrape_until(url, lambda f: named(f, "drbalance_exchange_latency_seconds_count").get((), 0)
                             + named(f, "drbalance_exchange_latency_dropped_total").get((), 0) >= 3, timeout=30)
    finally:
        job.kill()
        job.wait()
        code, err = manager.stop()
    assert code == 0 and "Traceback" not in err, err
    assert 0 <= named(found, "drbalance_exchange_latency_seconds_sum")[()] < 60  # it was 1e+300
    assert named(found, "drbalance_exchange_latency_seconds_count") == {(): 1}  # the notice sent now
    assert named(found, "drbalance_exchange_latency_dropped_total") == {(): 2}


@pytest.mark.timeout(120)
def test_fifty_connections_held_open_leave_every_scrape_answered(capfd):
    """A connection costs a descriptor, not a thread, until its request, so connections held open
    to --metrics-port cannot starve scrapes (with one of 16 server threads each, twenty of them
    would leave almost every scrape closed unanswered). Here 50 are held open (each opened again
    as soon as the server closes it) while 20 scrapes are made."""
    server = ManagerMetrics("ns7", "fair")
    host, port = server.serve("127.0.0.1", 0)
    answered = []
    try:
        with HeldConnections(host, port, 50) as held:
            for _ in range(20):
                with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
                    answered.append(reply.status == 200 and b"drbalance_apps" in reply.read())
            assert held.holding()  # the 50 were held all along
    finally:
        server.close()
    assert answered == [True] * 20
    assert "Traceback" not in capfd.readouterr().err
