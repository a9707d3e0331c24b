"""Only for the optional C accelerator of block-key hashing; everything else is in
pyproject.toml. If the compiler or Python headers are missing, the build of the extension
is skipped and kvroute uses its pure-Python path (same keys, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvroute.core._chainhash",
            sources=["kvroute/core/_native/chainhash.c"],
            include_dirs=["kvroute/core/_native"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
