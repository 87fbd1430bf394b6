"""Which S3 client for the object store (issue 17): obstore against boto3, on moto's server.

Not part of ``make bench`` (its packages are not featbake's dependencies yet). Run it with::

    python -m venv /tmp/s3 && /tmp/s3/bin/pip install "moto[server]" boto3 obstore
    /tmp/s3/bin/python benchmarks/s3_clients.py

It starts ``moto.server`` on a free loopback port and measures, per client, the calls the object
store will make: a ranged GET of one tensor (96 KiB of a 2 MiB object), a HEAD, with the client
CPU of this process (all threads) beside the wall time, since moto's own cost is not S3's; a
64 MiB PUT and GET; a create-if-absent PUT (``If-None-Match: *``) over an existing object; the
import time; and a client made before ``fork()`` used in the child (DataLoader workers fork).
"""

from __future__ import annotations

import io
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

BUCKET = "featbake-clients"
SMALL, SPAN, BIG = 2 << 20, 96 << 10, 64 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """moto's server on a free loopback port, and its URL; its stderr (werkzeug's access log,
    a line per request) written to ``log`` when given."""
    port = free_port()
    cmd = [sys.executable, "-m", "moto.server", "-p", str(port)]
    if log is None:
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        with log.open("wb") as out:  # the child holds its own descriptor
            server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    return server, f"http://127.0.0.1:{port}"


def per_call(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """Median over 3 rounds of (wall ms, client CPU ms) per call."""
    walls, cpus = [], []
    for _ in range(3):
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            fn()
        walls.append((time.perf_counter() - w0) / n * 1e3)
        cpus.append((time.process_time() - c0) / n * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def in_forked_child(fn: Callable[[], object]) -> str:
    """Run ``fn`` in a forked child: ok, hung (killed after 20 s) or failed."""
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        try:
            fn()
            os._exit(0)
        except BaseException:
            os._exit(3)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return "ok" if code == 0 else "hung" if code == -signal.SIGALRM else f"failed ({code})"


def main() -> None:
    server, url = start_moto()
    os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_REGION="us-east-1")
    try:
        t0 = time.perf_counter()
        import boto3

        boto3_import = time.perf_counter() - t0
        t0 = time.perf_counter()
        import obstore as obs
        from obstore.store import S3Store

        obstore_import = time.perf_counter() - t0
        b3 = boto3.client("s3", endpoint_url=url)
        b3.create_bucket(Bucket=BUCKET)
        ob = S3Store(
            BUCKET, endpoint=url, region="us-east-1", access_key_id="x", secret_access_key="x",
            virtual_hosted_style_request=False, client_options={"allow_http": True},
        )  # fmt: skip
        small, big = os.urandom(SMALL), os.urandom(BIG)
        obs.put(ob, "small", small)
        rng = random.Random(0)

        def span() -> tuple[int, int]:
            o = rng.randrange(0, SMALL - SPAN)
            return o, o + SPAN - 1

        def get_b3() -> None:
            a, b = span()
            b3.get_object(Bucket=BUCKET, Key="small", Range=f"bytes={a}-{b}")["Body"].read()

        def get_ob() -> None:
            a, _ = span()
            bytes(obs.get_range(ob, "small", start=a, length=SPAN))

        rows: dict[str, dict[str, object]] = {"boto3": {}, "obstore": {}}
        rows["boto3"]["ranged GET ms (wall, client CPU)"] = per_call(get_b3, 100)
        rows["obstore"]["ranged GET ms (wall, client CPU)"] = per_call(get_ob, 100)
        head_b3 = lambda: b3.head_object(Bucket=BUCKET, Key="small")  # noqa: E731
        rows["boto3"]["HEAD ms (wall, client CPU)"] = per_call(head_b3, 100)
        rows["obstore"]["HEAD ms (wall, client CPU)"] = per_call(lambda: obs.head(ob, "small"), 100)
        t0 = time.perf_counter()
        b3.upload_fileobj(io.BytesIO(big), BUCKET, "big-b3")
        rows["boto3"]["PUT 64 MiB s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        obs.put(ob, "big-ob", big)
        rows["obstore"]["PUT 64 MiB s"] = time.perf_counter() - t0
        rows["boto3"]["GET 64 MiB ms"] = per_call(
            lambda: b3.get_object(Bucket=BUCKET, Key="big-b3")["Body"].read(), 1
        )
        rows["obstore"]["GET 64 MiB ms"] = per_call(lambda: bytes(obs.get(ob, "big-ob").bytes()), 1)
        rows["boto3"]["create-if-absent refused"] = _refused(
            lambda: b3.put_object(Bucket=BUCKET, Key="small", Body=b"x", IfNoneMatch="*")
        )
        rows["obstore"]["create-if-absent refused"] = _refused(
            lambda: obs.put(ob, "small", b"x", mode="create")
        )
        rows["boto3"]["import s"] = boto3_import
        rows["obstore"]["import s"] = obstore_import
        rows["boto3"]["made before fork, used in the child"] = in_forked_child(get_b3)
        rows["obstore"]["made before fork, used in the child"] = in_forked_child(get_ob)
    finally:
        server.terminate()
    for client, measured in rows.items():
        print(client)
        for what, value in measured.items():
            shown = ", ".join(f"{v:.2f}" for v in value) if isinstance(value, tuple) else value
            print(
                f"  {what:40s} {shown:.40s}"
                if isinstance(shown, str)
                else f"  {what:40s} {shown:.3f}"
            )


def _refused(put: Callable[[], object]) -> str:
    try:
        put()
    except Exception as e:  # each client has its own exception for 412 Precondition Failed
        return f"yes ({type(e).__name__})"
    return "no: overwrote the object"


if __name__ == "__main__":
    main()
