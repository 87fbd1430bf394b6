"""A store's URL (``s3://bucket/prefix``) read into its parts; pure, no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass

from featbake.errors import ConfigError

#: ``s3://``, ``gs://``, ``az://``, ``https://``...: a URL rather than a directory (one slash is
#: enough: a URL that went through ``pathlib.Path`` reads ``s3:/bucket``).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/+(.*)$")

#: The schemes featbake's object store speaks (S3's API: AWS, MinIO, R2, Ceph, GCS's interop).
SCHEMES = ("s3",)


def is_url(where: str) -> bool:
    """True if ``where`` names a URL (``s3://...``) rather than a directory.

    Example:
        >>> is_url("s3://bucket/features"), is_url("/data/features")
        (True, False)
    """
    return _URL.match(where) is not None


@dataclass(frozen=True)
class BucketURL:
    """``s3://bucket/prefix``: a bucket and a key prefix inside it (no leading or trailing /)."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, where: str) -> BucketURL:
        """``where`` read as an ``s3://bucket[/prefix]`` URL.

        Raises:
            ConfigError: not a URL, a scheme featbake does not speak, or no bucket.

        Example:
            >>> BucketURL.parse("s3://team-features/wav2vec2/")
            BucketURL(bucket='team-features', prefix='wav2vec2')
        """
        m = _URL.match(where)
        if m is None:
            raise ConfigError(f"{where!r} is not a URL; a bucket store is s3://bucket/prefix")
        scheme, rest = m.group(1).lower(), m.group(2)
        if scheme not in SCHEMES:
            raise ConfigError(
                f"featbake stores speak S3 ({', '.join(s + '://' for s in SCHEMES)}), not "
                f"{scheme}://; for Google Cloud Storage use its S3 interoperability endpoint "
                "(AWS_ENDPOINT_URL=https://storage.googleapis.com with HMAC keys) and s3://"
            )
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ConfigError(f"{where!r} names no bucket; write s3://bucket/prefix")
        return cls(bucket, prefix.strip("/"))

    def key(self, name: str) -> str:
        """The object key of ``name`` (a path inside the store) under this URL's prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
