"""Only for the optional C accelerators of the routing hot path; everything else is in
pyproject.toml. If the compiler or Python headers are missing, the build of an extension is
skipped and kvroute uses its pure-Python path (same results, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvroute.core._chainhash",  # block-key hashing (core/blocks.py)
            sources=["core/_native/chainhash.c"],
            include_dirs=["vendor/xxhash"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "kvroute.core._holders",  # the prefix index's key -> holders map (holders.py)
            sources=["core/_native/holders.c", "core/_native/holder_table.c",
                     "core/_native/holder_walk.c"],
            depends=["core/_native/holders.h"],
            # Only PyInit__holders is exported: the parts' shared functions stay private.
            extra_compile_args=["-O3", "-fvisibility=hidden"],
            optional=True,
        ),
        Extension(
            "kvroute.core._costs",  # the kvroute policy's sums over load columns (columns.py)
            sources=["core/_native/costs.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "kvroute.core._wire",  # a request's token ids off the wire (wire.py)
            sources=["core/_native/wire.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
