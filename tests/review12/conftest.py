"""The loopback S3 server and per-test bucket of the bucket-store tests, for the resume of a
block order over a bucket store."""

from tests.serve.test_mixing import two_stores  # noqa: F401 - the two-store fixture, shared
from tests.store.bucket.conftest import (  # noqa: F401  (fixtures, shared)
    s3,
    s3_server,
)
