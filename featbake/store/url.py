"""A store's URL (``s3://``, ``gs://``, ``az://bucket/prefix``) read into its parts, and the
endpoints each cloud's own settings name; pure, no I/O (environments are passed in)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from urllib.parse import SplitResult, urlsplit

from featbake.errors import ConfigError

# == url ===========================================================================================
#: ``s3://``, ``gs://``, ``az://``, ``https://``...: a URL rather than a directory (one slash is
#: enough: a URL that went through ``pathlib.Path`` reads ``s3:/bucket``).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/+(.*)$")

#: The schemes featbake's object stores speak: S3's API (AWS, MinIO, R2, Ceph), Google Cloud
#: Storage, Azure Blob Storage (``az://container/prefix``).
SCHEMES = ("s3", "gs", "az")

#: A scheme alone (``s3:``, ``s3:/``): what ``--cache s3://$EMPTY`` becomes once a shell or
#: ``pathlib`` folds its slashes. A URL with no bucket, never a folder named ``s3:``.
_BARE_SCHEME = re.compile(r"^(s3|gs|az):/*$", re.IGNORECASE)

#: What S3-compatible servers accept in a bucket name (AWS's rules are stricter; legacy buckets
#: and some servers allow capitals and underscores).
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")

#: ``scheme://user:password@`` inside any text: what :func:`redact` hides.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s\"']+@")
#: An Azure connection string's key or signature, a SAS URL's ``sig=``: hidden too.
_SECRET_FIELD = re.compile(r"(?P<field>AccountKey|SharedAccessSignature|sig)=[^;&\s\"']+", re.I)

#: The variables that name an S3 endpoint, most specific first (botocore's order).
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def is_url(where: str) -> bool:
    """True if ``where`` names a URL (``s3://...``) rather than a directory.

    Example:
        >>> is_url("s3://bucket/features"), is_url("/data/features")
        (True, False)
    """
    return _URL.match(where) is not None or _BARE_SCHEME.match(where) is not None


class StoreKind(Enum):
    """Where a store lives: a directory, or a bucket (``s3://``, ``gs://``, ``az://``), as the
    options that act on one kind only see it."""

    DIRECTORY = "a directory store"
    BUCKET = "a bucket store"


def store_kind(where: str) -> StoreKind:
    """The kind of the store ``where`` (``--cache``) names.

    >>> store_kind("s3://team/features"), store_kind("./.featbake")
    (<StoreKind.BUCKET: 'a bucket store'>, <StoreKind.DIRECTORY: 'a directory store'>)
    """
    return StoreKind.BUCKET if is_url(where) else StoreKind.DIRECTORY


def redact(text: str) -> str:
    """``text`` with the credentials of any URL in it hidden (``http://***@host``): an endpoint
    may carry them, and they must reach neither a message nor a folder name.

    Example:
        >>> redact("cannot reach http://ak:secret@minio:9000/b")
        'cannot reach http://***@minio:9000/b'
    """
    return _SECRET_FIELD.sub(r"\g<field>=***", _USERINFO.sub(r"\g<scheme>***@", text))


def named_endpoint(env: Mapping[str, str]) -> tuple[str, str]:
    """(variable, value) of the endpoint ``env`` names, unchecked; ``("", "")`` for AWS."""
    return next(((v, env[v]) for v in ENDPOINT_VARS if env.get(v)), ("", ""))


def endpoint_from(env: Mapping[str, str]) -> str | None:
    """The S3 endpoint ``env`` names (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``), checked;
    None for AWS itself.

    Raises:
        ConfigError: an endpoint boto3 would reject with an internal error (no scheme, no host,
            a port out of range), named without its credentials.

    Example:
        >>> endpoint_from({"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"})
        'http://127.0.0.1:9000'
    """
    var, value = named_endpoint(env)
    if not value:
        return None
    return checked_endpoint(var, value, "AWS_ENDPOINT_URL=http://127.0.0.1:9000")


def checked_endpoint(var: str, value: str, example: str) -> str:
    """``value``, the endpoint setting ``var`` names, if it is an http(s) URL with a host: what
    each cloud's client takes. Its client would reject another in its first request, with an
    internal error (requests' ``InvalidSchema``) or as a network fault (an SSL error).

    Raises:
        ConfigError: it is not one (one line, named without its credentials, with ``example``).

    Example:
        >>> checked_endpoint("X", "http://127.0.0.1:9000", "X=http://127.0.0.1:9000")
        'http://127.0.0.1:9000'
    """
    parts = _split(value)
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{var}={redact(value)!r} is not an endpoint URL; write it as http://host:port or "
            f"https://host (a port from 1 to 65535), e.g. {example}"
        )
    return value


def _split(value: str) -> SplitResult | None:
    """``value`` split as a URL; None where it is not one (an unclosed IPv6 bracket, a port
    that is not a number from 0 to 65535), which ``urlsplit`` or its ``port`` raise for."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  (parsed on first use)
    except ValueError:
        return None
    return parts


def endpoint() -> str | None:
    """This process's S3 endpoint (:func:`endpoint_from` over ``os.environ``)."""
    return endpoint_from(os.environ)


def endpoint_label() -> str:
    """How messages name the endpoint: its URL without credentials, or AWS."""
    _, value = named_endpoint(os.environ)
    return redact(value) if value else "AWS (no AWS_ENDPOINT_URL is set)"


def endpoint_folder(value: str | None) -> str:
    """The tier's folder for an endpoint: two servers with a bucket of one name (a MinIO and
    AWS, a test server) must not share a tier's catalog; credentials never name a folder.

    Example:
        >>> endpoint_folder("http://ak:secret@127.0.0.1:9000")
        '127.0.0.1_9000'
    """
    if not value:
        return "aws"
    parts = _split(value)  # ConfigError: not a URL (each cloud's endpoint comes through here)
    if parts is None:
        raise ConfigError(
            f"the endpoint {redact(value)!r} is not a URL; write it as http://host:port or "
            "https://host (AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST, or the BlobEndpoint of "
            "AZURE_STORAGE_CONNECTION_STRING)"
        )
    where = (parts.hostname or "") + (f":{parts.port}" if parts.port else "") + parts.path
    return re.sub(r"[^A-Za-z0-9.-]+", "_", where).strip("_") or "endpoint"


#: Google Cloud Storage's endpoint (``STORAGE_EMULATOR_HOST`` names another: an emulator).
GCS_ENDPOINT = "https://storage.googleapis.com"


def gcs_endpoint(env: Mapping[str, str]) -> str:
    """The endpoint a ``gs://`` store talks to: ``STORAGE_EMULATOR_HOST`` (an emulator, as
    google-cloud-storage reads it), else Google's.

    Example:
        >>> gcs_endpoint({"STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443"}), gcs_endpoint({})
        ('http://127.0.0.1:4443', 'https://storage.googleapis.com')
    """
    host = env.get("STORAGE_EMULATOR_HOST", "")
    if not host:
        return GCS_ENDPOINT
    return host if "://" in host else f"http://{host}"


def gcs_emulator(env: Mapping[str, str]) -> str | None:
    """The emulator endpoint ``STORAGE_EMULATOR_HOST`` names, checked, for the ``gs://``
    client to be given (None: Google's own). Written ``host:port`` (as Google's Go and Java
    clients and the gcloud CLI take it) it is ``http://host:port`` (:func:`gcs_endpoint`);
    google-cloud-storage took the bare value as its URL, and every request was an internal
    error ("No connection adapters were found").

    Raises:
        ConfigError: it is not an http(s) endpoint (one line, saying how to write it).

    Example:
        >>> gcs_emulator({"STORAGE_EMULATOR_HOST": "127.0.0.1:4443"}), gcs_emulator({})
        ('http://127.0.0.1:4443', None)
    """
    if not env.get("STORAGE_EMULATOR_HOST"):
        return None
    example = "STORAGE_EMULATOR_HOST=http://127.0.0.1:4443"
    return checked_endpoint("STORAGE_EMULATOR_HOST", gcs_endpoint(env), example)


def connection_fields(text: str) -> dict[str, str]:
    """An Azure connection string's ``Name=value`` fields (names as written).

    Example:
        >>> connection_fields("AccountName=a;AccountKey=k==;")["AccountKey"]
        'k=='
    """
    fields = (part.partition("=") for part in text.split(";") if "=" in part)
    return {name.strip(): value.strip() for name, _, value in fields}


def azure_connection_endpoint(env: Mapping[str, str]) -> str | None:
    """The ``BlobEndpoint`` of ``AZURE_STORAGE_CONNECTION_STRING``, checked; None where it
    names none. azure-storage-blob takes one without a scheme as a host name to reach over
    HTTPS: Azurite's ``127.0.0.1:10000/devstoreaccount1`` failed each request as an SSL error.

    Raises:
        ConfigError: it is not an http(s) endpoint (one line, saying how to write it).

    Example:
        >>> connection = "AccountName=a;BlobEndpoint=http://127.0.0.1:10000/a/"
        >>> azure_connection_endpoint({"AZURE_STORAGE_CONNECTION_STRING": connection})
        'http://127.0.0.1:10000/a'
    """
    named = connection_fields(env.get("AZURE_STORAGE_CONNECTION_STRING", "")).get("BlobEndpoint")
    if not named:
        return None
    example = "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1 in the connection string"
    return checked_endpoint("BlobEndpoint", named, example).rstrip("/")


def azure_blob_endpoint(env: Mapping[str, str]) -> str:
    """The blob endpoint an ``az://`` store talks to: the connection string's ``BlobEndpoint``
    (Azurite's carries its account in the path), else its account's, else
    ``AZURE_STORAGE_ACCOUNT_NAME``'s. Never a key: it names the tier's folder.

    Raises:
        ConfigError: the environment names no account (what to set, in one line).

    Example:
        >>> azure_blob_endpoint({"AZURE_STORAGE_ACCOUNT_NAME": "team"})
        'https://team.blob.core.windows.net'
        >>> azure_blob_endpoint({"AZURE_STORAGE_CONNECTION_STRING": "hello"})
        Traceback (most recent call last):
        featbake.errors.ConfigError: AZURE_STORAGE_CONNECTION_STRING is set but names no ...
    """
    fields = connection_fields(env.get("AZURE_STORAGE_CONNECTION_STRING", ""))
    if fields.get("BlobEndpoint"):
        return fields["BlobEndpoint"].rstrip("/")  # checked where the client is made
    account = fields.get("AccountName") or env.get("AZURE_STORAGE_ACCOUNT_NAME", "")
    if not account and env.get("AZURE_STORAGE_CONNECTION_STRING", "").strip():
        raise ConfigError(
            "AZURE_STORAGE_CONNECTION_STRING is set but names no AccountName or BlobEndpoint "
            "(it holds name=value pairs split by ';'); copy it again from the portal's Access "
            "keys, or Azurite's: DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            "AccountKey=...;BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1"
        )
    if not account:
        raise ConfigError(
            "an az:// store needs its storage account: set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT_NAME (with AZURE_STORAGE_KEY, or azure-identity installed)"
        )
    protocol = fields.get("DefaultEndpointsProtocol", "https")
    suffix = fields.get("EndpointSuffix", "core.windows.net")
    return f"{protocol}://{account}.blob.{suffix}"


@dataclass(frozen=True)
class BucketURL:
    """``scheme://bucket/prefix``: a bucket (an Azure container) and a key prefix inside it (no
    leading or trailing /), in the object store of ``scheme`` (``s3``, ``gs``, ``az``)."""

    bucket: str
    prefix: str = ""
    scheme: str = "s3"

    @classmethod
    def parse(cls, where: str) -> BucketURL:
        """``where`` read as a ``scheme://bucket[/prefix]`` URL.

        Raises:
            ConfigError: not a URL, a scheme featbake does not speak, no bucket, or a prefix
                with an empty, ``.`` or ``..`` folder.

        Example:
            >>> BucketURL.parse("s3://team-features/wav2vec2/")
            BucketURL(bucket='team-features', prefix='wav2vec2', scheme='s3')
            >>> str(BucketURL.parse("az://features/w2v"))
            'az://features/w2v'
        """
        if _BARE_SCHEME.match(where):
            raise ConfigError(
                f"{where!r} names no bucket (an empty variable in --cache s3://$BUCKET?); write "
                "scheme://bucket/prefix (s3://, gs:// or az://)"
            )
        m = _URL.match(where)
        if m is None:
            raise ConfigError(
                f"{where!r} is not a URL; a bucket store is s3://bucket/prefix, "
                "gs://bucket/prefix or az://container/prefix"
            )
        scheme, rest = m.group(1).lower(), m.group(2)
        if scheme not in SCHEMES:
            raise ConfigError(
                f"featbake stores speak {', '.join(s + '://' for s in SCHEMES)}, not {scheme}://; "
                "write s3://bucket/prefix (AWS, MinIO, R2), gs://bucket/prefix (Google Cloud "
                "Storage) or az://container/prefix (Azure Blob Storage)"
            )
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ConfigError(f"{where!r} names no bucket; write {scheme}://bucket/prefix")
        if not _BUCKET.match(bucket):
            raise ConfigError(
                f"{bucket!r} is not a bucket name (letters, digits, '.', '-' and '_', 2 to 255 "
                f"of them, starting with a letter or digit); fix the {scheme}:// URL"
            )
        prefix = prefix.strip("/")
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ConfigError(
                f"'{scheme}://{bucket}/{prefix}' has an empty, '.' or '..' folder in its prefix: "
                "the object store takes them as names, where a path would not (another store's "
                "local tier, or a tier outside --local-cache); write the prefix plainly, e.g. "
                f"{scheme}://{bucket}/features"
            )
        return cls(bucket, prefix, scheme)

    def key(self, name: str) -> str:
        """The object key of ``name`` (a path inside the store) under this URL's prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        where = f"{self.scheme}://{self.bucket}"
        return f"{where}/{self.prefix}" if self.prefix else where
