"""The loopback S3 server and per-test bucket of the bucket-store tests, for the resume of a
block order over a bucket store."""

from tests.store.bucket.conftest import (  # noqa: F401  (fixtures, shared)
    s3,
    s3_server,
)
