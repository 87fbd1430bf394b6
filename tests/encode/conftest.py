"""The loopback S3 server and per-test bucket of the bucket-store tests, for bucket inputs."""

from tests.store.bucket.conftest import s3, s3_server  # noqa: F401  (fixtures, shared)
