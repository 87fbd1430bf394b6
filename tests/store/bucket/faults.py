"""A TCP proxy on loopback that cuts responses: a server that drops connections mid-body, one
that does a request and loses its answer, or one that stalls (sends no answer, or an answer's
head and a few bytes of its body, then nothing, its connection held open). It records the
requests it forwards, so a test counts what a client asked for."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from enum import Enum
from typing import NamedTuple

#: An answer's head ends here.
_HEAD_END = b"\r\n\r\n"


class Asked(NamedTuple):
    """One request the proxy forwarded: its method, its target (path and query), its head."""

    method: str
    target: str
    head: str

    def names(self, key: str) -> bool:
        """Whether the request's path ends with object ``key`` (plain or URL-encoded)."""
        path = self.target.partition("?")[0]
        return path.endswith((key, key.replace("/", "%2F")))


class Stall(NamedTuple):
    """Which answers a proxy holds back, and how much of each it sends first: ``body`` None,
    nothing (the server read the request and never answers); a number, the answer's head and
    that many bytes of its body. Then nothing, until the client gives up and closes."""

    asks: Callable[[Asked], bool]
    body: int | None = None


class _Part(Enum):
    """Where a request stream is: in a head, a body of known length, a chunked body."""

    HEAD = "head"
    BODY = "body"
    CHUNK_SIZE = "chunk size"
    CHUNK = "chunk"
    TRAILER = "trailer"


class RequestStream:
    """The heads of the HTTP/1.1 requests in one connection's bytes from client to server, fed
    as they come: each head, then its body skipped (``Content-Length`` bytes, or chunked)."""

    def __init__(self) -> None:
        self._buf = b""
        self._part = _Part.HEAD
        self._left = 0

    def feed(self, data: bytes) -> list[Asked]:
        """The requests whose heads ``data`` completed, in order."""
        self._buf += data
        heads: list[Asked] = []
        while self._step(heads):
            pass
        return heads

    def _step(self, heads: list[Asked]) -> bool:
        """Consume one part of the buffer; False when it needs more bytes."""
        if self._part in (_Part.BODY, _Part.CHUNK):
            taken = min(self._left, len(self._buf))
            self._buf, self._left = self._buf[taken:], self._left - taken
            if self._left:
                return False
            self._part = _Part.HEAD if self._part is _Part.BODY else _Part.CHUNK_SIZE
            return True
        end = self._buf.find(b"\r\n\r\n" if self._part is _Part.HEAD else b"\r\n")
        if end < 0:
            return False
        line, self._buf = self._buf[:end], self._buf[end + (4 if self._part is _Part.HEAD else 2) :]
        if self._part is _Part.HEAD:
            heads.append(self._head(line.decode("latin-1")))
        elif self._part is _Part.CHUNK_SIZE:
            size = int(line.split(b";")[0], 16)
            self._part, self._left = (_Part.CHUNK, size + 2) if size else (_Part.TRAILER, 0)
        elif not line:  # the empty line that ends a chunked body's trailers
            self._part = _Part.HEAD
        return True

    def _head(self, text: str) -> Asked:
        first, *lines = text.split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
        method, target = [*first.split(), "", ""][:2]
        if "chunked" in fields.get("transfer-encoding", "").lower():
            self._part = _Part.CHUNK_SIZE
        elif int(fields.get("content-length", "0") or 0) > 0:
            self._part, self._left = _Part.BODY, int(fields["content-length"])
        return Asked(method, target, text)


class _Link:
    """One client connection and its connection upstream; the requests the client sent on it,
    and whether the next answer is to be lost."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.asked: list[Asked] = []
        self.lose_next = False
        self.stall_next: Stall | None = None
        self.answered = 0  # bytes of the answer to the last request sent back so far
        self.closed = threading.Event()  # set when either direction ends

    def last_target(self) -> str:
        return self.asked[-1].target if self.asked else ""


def _interim_split(data: bytes) -> tuple[bytes, bytes]:
    """(a ``100 Continue`` head at the start of ``data``, the rest): a server may send the
    interim head and the final answer in one read (under load, the proxy reads late), and the
    final answer is the one to cut, lose or hold."""
    if not data.startswith(b"HTTP/1.1 100 "):
        return b"", data
    end = data.find(_HEAD_END)
    if end < 0:
        return data, b""  # an interim head split over reads: its rest comes next
    return data[: end + len(_HEAD_END)], data[end + len(_HEAD_END) :]


class DroppingProxy:
    """Forwards loopback connections to ``upstream_port``; the first ``drops`` answers that
    pass ``after`` bytes are cut there (both sockets closed mid-body). With
    ``lose_answer``, the answer to the first request whose head it accepts is never sent:
    the server did the request (a write is stored), and its connection closes unanswered.
    With ``refuse``, each request whose head it accepts is never forwarded (the server never
    sees it): its connection closes unanswered. With ``stall``, every answer to a request it
    picks is held back (:class:`Stall`): the connection stays open, silent, until the client
    closes it (or the proxy is closed).

    ``requests`` lists every request forwarded (recorded before it goes upstream, so a client
    that has its answer finds it there; a refused one too), ``cut`` the targets whose answers
    were cut or lost (or that were refused), ``stalled`` those whose answers were held back.
    Leaving the context closes the listening socket and every connection, and joins the
    proxy's threads.

    Example:
        >>> with DroppingProxy(9000, drops=2) as proxy: ...  # doctest: +SKIP
        ...     os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
    """

    def __init__(
        self,
        upstream_port: int,
        *,
        drops: int,
        after: int = 16 << 10,
        lose_answer: Callable[[Asked], bool] | None = None,
        refuse: Callable[[Asked], bool] | None = None,
        stall: Stall | None = None,
    ) -> None:
        self.upstream_port = upstream_port
        self.drops_left = drops
        self.after = after
        self.lose_answer = lose_answer
        self.refuse = refuse
        self.stall = stall
        self.dropped = 0
        self.requests: list[Asked] = []
        self.cut: list[str] = []
        self.stalled: list[str] = []
        self.threads: list[threading.Thread] = []
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._stop = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DroppingProxy:
        """Start accepting connections (:meth:`close` ends it)."""
        self._start(self._accept)
        return self

    def __enter__(self) -> DroppingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting (a shutdown wakes the thread blocked in ``accept``, which closing
        the socket alone does not), close every connection, and join the threads."""
        with self._lock:
            self._stop = True
            sockets = [self._server] + [s for k in self._links for s in (k.client, k.upstream)]
            threads = list(self.threads)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        for t in threads:
            t.join(10)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # shut down by close()
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()  # no server behind: the client sees its connection closed
                continue
            link = _Link(client, upstream)
            with self._lock:
                if self._stop:
                    client.close()
                    upstream.close()
                    return
                self._links.append(link)
                self._start(self._pump_asks, link)
                self._start(self._pump_answers, link)

    def _take_drop(self) -> bool:
        with self._lock:
            if self.drops_left <= 0:
                return False
            self.drops_left -= 1
            self.dropped += 1
            return True

    def _pump_asks(self, link: _Link) -> None:
        stream = RequestStream()
        with self._closing(link):
            while data := link.client.recv(65536):
                for asked in stream.feed(data):
                    if self.refuse is not None and self.refuse(asked):
                        with self._lock:
                            self.requests.append(asked)
                            self.cut.append(asked.target)
                        return  # closes both sockets; what it read goes nowhere
                    with self._lock:
                        self.requests.append(asked)
                        link.asked.append(asked)
                        link.answered = 0  # the answer to the request before came whole
                        if self.lose_answer is not None and self.lose_answer(asked):
                            self.lose_answer = None
                            link.lose_next = True
                        if self.stall is not None and self.stall.asks(asked):
                            link.stall_next = self.stall
                            self.stalled.append(asked.target)
                link.upstream.sendall(data)

    def _pump_answers(self, link: _Link) -> None:
        with self._closing(link):
            while data := link.upstream.recv(65536):
                interim, data = _interim_split(data)
                if interim:  # 100 Continue (the body follows): passed on, never cut or lost
                    link.client.sendall(interim)
                    if not data:
                        continue
                if link.lose_next:
                    self._record_cut(link)
                    return
                if link.stall_next is not None:
                    self._hold(link, link.stall_next, data)
                    return
                if link.answered + len(data) > self.after and self._take_drop():
                    link.client.sendall(data[: max(self.after - link.answered, 0)])
                    self._record_cut(link)
                    return
                link.client.sendall(data)
                link.answered += len(data)

    def _hold(self, link: _Link, stall: Stall, data: bytes) -> None:
        """Send the start of an answer that ``stall`` picked (nothing, or its head and
        ``stall.body`` bytes of its body, read from upstream as they come), then nothing until
        the connection closes."""
        if stall.body is not None:
            while _HEAD_END not in data and (more := link.upstream.recv(65536)):
                data += more
            start = data.find(_HEAD_END) + len(_HEAD_END)
            while len(data) < start + stall.body and (more := link.upstream.recv(65536)):
                data += more
            link.client.sendall(data[: start + stall.body])
        link.closed.wait()

    def _record_cut(self, link: _Link) -> None:
        with self._lock:
            self.cut.append(link.last_target())

    @contextlib.contextmanager
    def _closing(self, link: _Link) -> Iterator[None]:
        """Run one direction of ``link``; when it ends (either side closed, or a cut), close
        both sockets, which ends the other direction too."""
        try:
            yield
        except OSError:
            pass
        finally:
            link.closed.set()
            for s in (link.client, link.upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
