"""genpool's PyTorch backend: a C++ ``c10::cuda::CUDACachingAllocator::CUDAAllocator`` over genpool's C ABI.

PyTorch's allocator interface is C++ with no stable ABI (its virtual methods change between minor
versions), so the backend is compiled against the torch that imports it, once, and cached: under
``$GENPOOL_SHIM_DIR`` (default ``~/.cache/genpool_torch``), keyed by the source, the genpool library,
torch's version and C++ ABI, and the compiler. That takes ~10-40 s the first time and nothing after.
A wheel built against one torch would break on the next; vLLM pins torch for the same reason, and RMM
goes through the pluggable hook (whose limits this backend exists to lift).

The compiler is ``$GENPOOL_CXX`` (default ``c++``, the system compiler), deliberately not ``$CXX``:
the C++ runtime must be the shared ``libstdc++`` that PyTorch catches exceptions with (on the H200
machine ``$CXX`` is a GCC that links its runtime statically into the library, and its exceptions then
crash the process instead of reaching Python). A result that defines its own ``__cxa_throw`` is refused.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

_HERE = Path(__file__).resolve().parent
SOURCE = _HERE / "csrc" / "genpool_backend.cpp"

#: Oldest torch whose allocator interface the backend is written for.
MIN_TORCH = (2, 11)


class BackendError(RuntimeError):
    """The backend could not be built or installed (the message says why and what to do)."""


def header_dir() -> Path:
    """The directory holding ``genpool.h`` (bundled in the package, or the repository's)."""
    for d in (_HERE / "include", _HERE.parent.parent / "crates" / "genpool-torch" / "include"):
        if (d / "genpool.h").is_file():
            return d
    raise BackendError("genpool.h not found (neither in the package nor in the repository)")


def _torch_version(torch) -> tuple:
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return tuple(int(p) for p in parts[:2])
    except ValueError:
        return (0, 0)


def _cuda_dirs(torch) -> tuple:
    """(include dirs, library dirs) of the CUDA runtime torch was built with."""
    incs: List[str] = []
    libs: List[str] = []
    try:
        from torch.utils import cpp_extension

        home = cpp_extension.CUDA_HOME
    except Exception:  # noqa: BLE001 - a broken cpp_extension import only means no CUDA_HOME
        home = None
    home = os.environ.get("CUDA_HOME") or home
    if home:
        incs.append(os.path.join(home, "include"))
        for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            if os.path.isdir(os.path.join(home, sub)):
                libs.append(os.path.join(home, sub))
    # The CUDA wheels torch depends on (nvidia/cu13/include, nvidia/cuda_runtime/include ...).
    for p in sys.path:
        nv = Path(p) / "nvidia"
        if nv.is_dir():
            for inc in sorted(nv.glob("*/include")):
                if (inc / "cuda_runtime_api.h").is_file():
                    incs.append(str(inc))
                    libs.append(str(inc.parent / "lib"))
    return incs, libs


def _compiler() -> str:
    return os.environ.get("GENPOOL_CXX", "c++")


def compile_command(lib_path: Path, out: Path, torch=None) -> List[str]:
    """The command that builds the backend into ``out`` against ``torch`` (imported if not given)."""
    if torch is None:
        import torch  # noqa: F811
    tdir = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cuda_inc, cuda_lib = _cuda_dirs(torch)
    # torch 2.15's headers need C++20; 2.11 was validated with C++17.
    std = "-std=c++17" if _torch_version(torch) < (2, 12) else "-std=c++20"
    cmd = [
        _compiler(), "-O2", "-shared", "-fPIC", std, "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{tdir / 'include'}", f"-I{tdir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{header_dir()}",
    ]
    cmd += [f"-I{d}" for d in cuda_inc]
    cmd += [str(SOURCE), "-o", str(out), str(lib_path), f"-L{tdir / 'lib'}"]
    cmd += [f"-L{d}" for d in cuda_lib]
    cmd += [
        "-ltorch_cuda", "-ltorch_cpu", "-lc10_cuda", "-lc10", "-lcudart",
        f"-Wl,-rpath,{tdir / 'lib'}", f"-Wl,-rpath,{lib_path.parent}",
    ]
    return cmd


def build(lib_path: Path) -> Path:
    """Compile (once, cached) the backend against the imported torch and ``lib_path``; return its path."""
    import torch

    if _torch_version(torch) < MIN_TORCH:
        raise BackendError(
            f"torch {torch.__version__} is older than the {MIN_TORCH[0]}.{MIN_TORCH[1]} allocator "
            "interface the backend is written for"
        )
    if not torch.version.cuda:
        raise BackendError(f"torch {torch.__version__} was built without CUDA")
    src = SOURCE.read_text()
    header = (header_dir() / "genpool.h").read_text()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha1(
        f"{src}{header}{lib_path}{torch.__version__}{abi}{_compiler()}".encode()
    ).hexdigest()[:12]
    out_dir = Path(os.environ.get("GENPOOL_SHIM_DIR", Path.home() / ".cache" / "genpool_torch"))
    so = out_dir / f"genpool_backend_{key}.so"
    if so.is_file():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f"genpool_backend_{key}.{os.getpid()}.tmp"
    cmd = compile_command(lib_path, tmp, torch)
    return compile_cached(cmd, tmp, so, "the backend", BackendError)


def compile_cached(cmd: List[str], tmp: Path, so: Path, what: str, error=None) -> Path:
    """Run the compile command `cmd` (which writes `tmp`), refuse a result with a private C++ runtime,
    and move it to `so` atomically (concurrent processes never load a half-written file). Failures raise
    `error` (default `BackendError`) naming `what` was built."""
    error = error or BackendError
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise error(f"no C++ compiler ({cmd[0]}: {e}); set GENPOOL_CXX") from e
    if res.returncode != 0:
        raise error(f"building {what} failed:\n{' '.join(cmd)}\n{res.stderr[-3000:]}")
    try:
        nm = subprocess.run(["nm", "-D", "--defined-only", str(tmp)], capture_output=True, text=True)
        private_runtime = nm.returncode == 0 and " __cxa_throw" in nm.stdout
    except OSError:  # no nm: trust the compiler
        private_runtime = False
    if private_runtime:
        os.unlink(tmp)
        raise error(
            f"{cmd[0]} linked a private C++ runtime into {what} (it defines __cxa_throw), so its "
            "exceptions cannot reach PyTorch; set GENPOOL_CXX to the system compiler (e.g. /usr/bin/c++)"
        )
    os.replace(tmp, so)
    return so


_backend: Optional[ctypes.CDLL] = None


def install(lib_path: Path) -> ctypes.CDLL:
    """Build (if needed) and load the backend, and make it PyTorch's CUDA allocator."""
    global _backend
    if _backend is not None:
        return _backend
    so = build(lib_path)
    try:
        lib = ctypes.CDLL(str(so))
    except OSError as e:
        raise BackendError(f"cannot load the backend {so}: {e}") from e
    lib.genpool_backend_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.genpool_backend_install.restype = ctypes.c_int
    lib.genpool_backend_torch_version.restype = ctypes.c_char_p
    err = ctypes.create_string_buffer(2048)
    if lib.genpool_backend_install(err, len(err)) != 0:
        raise BackendError(err.value.decode("utf-8", "replace"))
    _backend = lib
    return lib


def installed() -> bool:
    """Whether the backend is PyTorch's allocator in this process."""
    return _backend is not None
