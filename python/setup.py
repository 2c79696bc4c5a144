"""Builds the Rust library ``libgenpool_torch`` (crate ``crates/genpool-torch`` of the repository this
folder belongs to) with setuptools-rust and bundles it inside the ``genpool_torch`` package, with the C
header ``genpool.h`` (``genpool_torch/include/genpool.h``).

``pip install ./python`` (or ``pip wheel ./python -w dist``) from a checkout of the repository: pip builds
in place, so ``../crates/genpool-torch/Cargo.toml`` is found. An sdist cut from ``python/`` alone has no
Rust sources; ``GENPOOL_CRATE_DIR`` can point the build at a checkout's ``crates/genpool-torch``.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools_rust import Binding, RustExtension, Strip

HERE = Path(__file__).resolve().parent
CRATE = Path(os.environ.get("GENPOOL_CRATE_DIR") or HERE.parent / "crates" / "genpool-torch").resolve()
MANIFEST = CRATE / "Cargo.toml"
HEADER = CRATE / "include" / "genpool.h"

if not MANIFEST.is_file():
    sys.exit(
        f"genpool-torch: the Rust crate is not at {MANIFEST}; build from a checkout of the genpool "
        "repository (`pip install ./python` from its root) or set GENPOOL_CRATE_DIR to its crates/genpool-torch"
    )


class BuildPyWithHeader(build_py):
    """Copies the C ABI's header into the package (``genpool_torch/include/genpool.h``), for the C++
    backend compiled at first use."""

    def run(self):
        super().run()
        dest = Path(self.build_lib) / "genpool_torch" / "include"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HEADER, dest / "genpool.h")


setup(
    rust_extensions=[
        RustExtension(
            # A plain C-ABI cdylib loaded with ctypes (no Python bindings): installed as
            # genpool_torch/libgenpool_torch<EXT_SUFFIX>, found by genpool_torch._candidates().
            "genpool_torch.libgenpool_torch",
            path=str(MANIFEST),
            binding=Binding.NoBinding,
            py_limited_api=False,
            debug=False,
            # The release profile keeps debug info (27 MB); the wheel ships the library without it.
            strip=Strip.Debug,
        )
    ],
    cmdclass={"build_py": BuildPyWithHeader},
    zip_safe=False,
)
