"""Stores named by a URL: ``s3://``, ``gs://``, ``az://`` open a bucket store; other schemes,
and a URL where only a directory will do (CachedEncoder), are refused in one line, before
anything is created."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from featbake.errors import ConfigError
from featbake.serve.cached_encoder import CachedEncoder
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import Catalog
from featbake.store.open import open_store
from featbake.store.url import BucketURL
from tests.conftest import invoke


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [("s3://team/features", "team", "features"), ("s3://team", "team", ""),
     ("s3:/team/a/b/", "team", "a/b")],
)  # fmt: skip
def test_an_s3_url_names_a_bucket_and_a_prefix(url: str, bucket: str, prefix: str) -> None:
    assert BucketURL.parse(url) == BucketURL(bucket, prefix)


@pytest.mark.parametrize("scheme", ["gs", "az", "GS"])
def test_gs_and_az_urls_name_a_bucket_a_prefix_and_their_scheme(scheme: str) -> None:
    url = BucketURL.parse(f"{scheme}://team/a/b/")
    assert url == BucketURL("team", "a/b", scheme.lower())
    assert str(url) == f"{scheme.lower()}://team/a/b"


@pytest.mark.parametrize(
    "url", ["s3://team/a/../features", "gs://team/../../../outside", "az://cc/./f", "s3://tt/a/.."]
)
def test_a_prefix_with_a_dot_folder_is_refused(url: str, tmp_path: Path) -> None:
    """An object store takes ``..`` as a name where the tier's path walks up: ``s3://b/../x``
    put its tier outside ``--local-cache``, and ``s3://b/a/../f`` shared the tier of
    ``s3://b/f`` while naming other objects."""
    with pytest.raises(ConfigError, match=r"has an empty, '\.' or '\.\.' folder in its prefix"):
        BucketURL.parse(url)
    with pytest.raises(ConfigError, match="write the prefix plainly"):
        open_store(url, local_cache=tmp_path / "tiers")
    assert not (tmp_path / "tiers").exists()
    assert BucketURL.parse("s3://tt/a.b/..c/...").prefix == "a.b/..c/..."  # dots inside a name


@pytest.mark.parametrize("env", ["STORAGE_EMULATOR_HOST", "AZURE_STORAGE_CONNECTION_STRING"])
def test_a_malformed_endpoint_of_any_cloud_is_one_line(env: str, tmp_path: Path) -> None:
    """An unclosed IPv6 bracket in the endpoint: ``urlsplit`` raises ValueError, which was
    an internal error on every cloud (S3's setting: ``test_bucket_trust.py``)."""
    from featbake.store.url import endpoint_folder, endpoint_from

    value = "http://[::1:4443"
    if env == "AZURE_STORAGE_CONNECTION_STRING":
        value = f"AccountName=a;AccountKey=k;BlobEndpoint={value}/a;"
    scheme = "gs" if env == "STORAGE_EMULATOR_HOST" else "az"
    got = invoke(
        "stats", "--cache", f"{scheme}://team/f", "--local-cache", tmp_path, env={env: value}
    )
    assert got.returncode == 2 and "is not a URL" in got.stderr, got.stderr
    assert "internal error" not in got.stderr and len(got.stderr.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="not an endpoint URL"):
        endpoint_from({"AWS_ENDPOINT_URL": "http://[::1:9000"})
    with pytest.raises(ConfigError, match="is not a URL"):
        endpoint_folder("http://[::1:9000")


@pytest.mark.parametrize("url", ["hdfs://b/p", "https://host/store", "abfs://c/p"])
def test_a_url_of_another_scheme_is_refused_and_not_read_as_a_folder(url: str) -> None:
    with pytest.raises(ConfigError, match=r"speak s3://, gs://, az://"):
        open_store(url)
    assert not Path(url.split(":")[0] + ":").exists()


def test_cached_encoder_refuses_a_url_of_another_scheme_and_creates_no_folder() -> None:
    """A bucket URL opens as a bucket store (tests/store/bucket/test_bucket_cached_encoder.py);
    one featbake cannot open is refused in one line, never read as a folder."""
    with pytest.raises(ConfigError, match=r"speak s3://, gs://, az://"):
        CachedEncoder(torch.nn.Linear(2, 2), cache="hdfs://bucket/features")
    assert not Path("hdfs:").exists()


def test_build_and_stats_refuse_another_scheme_and_create_no_folder(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    for args in (
        ["build", "-e", encoder_file, "-d", audio_dir, "--cache", "hdfs://bucket/features"],
        ["stats", "--cache", "hdfs://bucket/features"],
    ):
        done = invoke(*args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "speak s3://" in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "hdfs:").exists()


def test_a_dataset_refuses_another_scheme(audio_dir: Path, encoder_file: Path) -> None:
    paths = sorted(audio_dir.rglob("*.wav"))
    with pytest.raises(ConfigError, match="speak s3://"):
        CachedFeatureDataset(paths, encoder_file, cache="hdfs://bucket/features")


def test_a_root_is_named_whole_or_by_a_prefix_of_two_characters_past_r() -> None:
    """``roots drop ""`` (a script's unset variable), ``r`` or ``r-`` matched every root and
    dropped a store's only one; a prefix must reach two characters past ``r-`` now. Several
    matches, and none, are refused as before."""
    from types import SimpleNamespace

    from featbake.errors import ConfigError
    from featbake.store.open import resolve_root

    roots = [SimpleNamespace(name=n) for n in ("r-ab12", "r-ab34", "r-c")]
    catalog = SimpleNamespace(roots=lambda: roots)
    assert resolve_root(catalog, "r-ab1").name == "r-ab12"  # type: ignore[arg-type]
    assert resolve_root(catalog, "r-c").name == "r-c"  # type: ignore[arg-type]  # whole
    refused = {"": "too short", "r": "too short", "r-": "too short", "r-a": "too short",
               "r-ab": "several roots", "r-zz": "no root"}  # fmt: skip
    for name, said in refused.items():
        with pytest.raises(ConfigError, match=said):
            resolve_root(catalog, name)  # type: ignore[arg-type]


def test_a_blank_store_path_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``FEATBAKE_CACHE=" "`` made a store in a folder named " " (no listing shows it), where
    an empty value is the default ``./.featbake``. A blank path is one line."""
    from featbake.errors import ConfigError
    from featbake.store.open import open_store

    monkeypatch.chdir(tmp_path)
    for blank in (" ", "\t"):
        monkeypatch.setenv("FEATBAKE_CACHE", blank)
        with pytest.raises(ConfigError, match="is blank"):
            open_store(None).ensure()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("inside", [".", "tiers", "shards/tiers"])
def test_a_bucket_tier_inside_a_directory_store_is_refused(tmp_path: Path, inside: str) -> None:
    """A tier in a store's folder puts the bucket's folders among the store's own."""
    store = tmp_path / "store"
    with Catalog(open_store(store).ensure()) as catalog:  # a store: its catalog and shards/
        catalog.conn.execute("SELECT 1")
    assert (store / "catalog.sqlite").is_file()
    before = sorted(p.name for p in store.iterdir())
    with pytest.raises(ConfigError, match=r"local cache .* is inside the featbake store"):
        open_store("s3://team/features", local_cache=store / inside)
    got = invoke("stats", "--cache", "s3://team/features", "--local-cache", store / inside)
    assert got.returncode == 2 and "outside any store" in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in store.iterdir()) == before  # nothing made in the store
    # Another program's catalog.sqlite above the tier is no store.
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "catalog.sqlite").write_bytes(b"")
    from featbake.store.open import _refuse_tier_in_store

    _refuse_tier_in_store(other / "tiers")


def test_a_store_in_a_folder_whose_name_is_not_utf8_builds_and_serves(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    """Every catalog connection is opened by ``file:`` URI: a folder named in another encoding
    than UTF-8 (surrogates in its str) made quoting the path fail, an internal error."""
    from featbake.bake.pipeline import build
    from tests.helpers import Live

    store = tmp_path / os.fsdecode(b"caf\xe9") / "store"
    report = build(audio_dir, encoder_file, cache=store, workers=0)
    assert not report.failed and report.encoded
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store, on_miss="error")
    live = Live()
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], live(encoder_file, Path(ds.path(i))))
