"""The loopback object-store servers and per-test buckets of the bucket-store tests, for bucket
inputs."""

from tests.store.bucket.conftest import (  # noqa: F401  (fixtures, shared)
    azurite_server,
    gcs_server,
    place,
    s3,
    s3_server,
)
