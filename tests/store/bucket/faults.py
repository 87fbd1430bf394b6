"""A TCP proxy on loopback that cuts responses mid-body: a server that drops connections."""

from __future__ import annotations

import contextlib
import socket
import threading


class DroppingProxy:
    """Forwards loopback connections to ``upstream_port``; the first ``drops`` connections
    whose answer passes ``after`` bytes are cut there (both sockets closed mid-body).

    Example:
        >>> with DroppingProxy(9000, drops=2) as proxy: ...  # doctest: +SKIP
        ...     os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
    """

    def __init__(self, upstream_port: int, *, drops: int, after: int = 16 << 10) -> None:
        self.upstream_port = upstream_port
        self.drops_left = drops
        self.after = after
        self.dropped = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._stop = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DroppingProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._server.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _take_drop(self) -> bool:
        with self._lock:
            if self.drops_left <= 0:
                return False
            self.drops_left -= 1
            self.dropped += 1
            return True

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if answers and sent + len(data) > self.after and self._take_drop():
                    dst.sendall(data[: max(self.after - sent, 0)])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
