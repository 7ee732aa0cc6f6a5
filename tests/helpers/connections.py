"""Connections held open to a TCP port, as any local user can hold them to a manager's metrics port."""

from __future__ import annotations

import select
import socket
import threading


class HeldConnections:
    """``count`` connections to ``host:port`` that send nothing, held open by a thread: each one the
    server closes is opened again at once (``reopened`` counts them). Use it in a ``with`` block."""

    def __init__(self, host: str, port: int, count: int) -> None:
        self.address = (host, port)
        self.count = count
        self.sockets: list[socket.socket] = []
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)

    def __enter__(self) -> HeldConnections:
        self.sockets = [socket.create_connection(self.address, timeout=30) for _ in range(self.count)]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for connection in self.sockets:
            connection.close()

    def holding(self) -> bool:
        """Whether the thread still holds them (it ends only when the block does, or on an error)."""
        return self._thread.is_alive()

    def _hold(self) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select(self.sockets, [], [], 0.1)
            for connection in readable:
                if connection.recv(1) == b"":  # closed by the server: open another
                    connection.close()
                    self.sockets[self.sockets.index(connection)] = socket.create_connection(self.address, timeout=30)
                    self.reopened += 1
