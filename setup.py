"""The optional C extension ``featbake.kernels`` (everything else is in pyproject.toml).

``optional=True``: where no C compiler is present the build prints a warning and goes on, and
featbake reads through its pure-Python path (the same bytes, slower: see featbake/kernels.c).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "featbake.kernels",
            sources=["featbake/kernels.c"],
            # Exact float32 products, rounded once: no fused multiply-adds, no fast-math.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
