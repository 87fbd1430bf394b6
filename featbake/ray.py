"""featbake on Ray Data: ``featbake.ray.encode(ds, encoder=..., cache=..., column=...)``.

Encodes a user's own ``ray.data.Dataset`` (each row's bytes in ``column``) into a store on an
actor pool, keyed exactly as a folder build keys files; ``featbake build --engine ray`` runs a
build's encode step the same way. Needs ``pip install 'featbake[ray]'``. See docs/scaling.md.
"""

from __future__ import annotations

from featbake.bake.ray_engine import RayEngine, encode

__all__ = ["RayEngine", "encode"]
