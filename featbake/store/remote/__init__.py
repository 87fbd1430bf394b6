"""The store in an S3-compatible bucket: one more place under ``store/``, with a local disk tier.

A bucket store is the local store's layout as objects (``shards/ab/<name>.safetensors``,
``fragments/<name>.sqlite``) plus catalogs published as immutable, numbered versions
(``catalog/v<N>.sqlite``). Every process works through a *local tier*: a local store directory
holding the newest catalog version, the shards it has fetched (byte-budgeted, least recently
used evicted) and the fragments it writes before they are uploaded. See docs/object_store.md.
"""
