"""genpool as PyTorch's CUDA allocator.

``install()`` makes genpool PyTorch's CUDA allocator through a C++ ``CUDAAllocator`` of its own
(``genpool_torch.backend``, built against the installed torch on first use), falling back to
``torch.cuda.memory.CUDAPluggableAllocator`` where that cannot be built; it must run before CUDA is
initialised. The statistics
helpers (``memory_stats()``, ``empty_cache()``, ``mark_iteration()``, ``step()`` ...) only need the shared
library, so they also work (and are tested) without PyTorch, on genpool's simulated device
(``GENPOOL_DEVICE=sim``).

The library is found, in order: the ``path`` argument, ``$GENPOOL_LIB``, ``libgenpool_torch.so`` next to
this file, the library ``pip install ./python`` bundled next to this file, then the repository's
``target/release`` and ``target/debug``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, Optional, Union

__all__ = [
    "GenpoolError",
    "GenpoolInstallError",
    "library_path",
    "install",
    "is_installed",
    "active_backend",
    "memory_stats",
    "raw_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "empty_cache",
    "trim",
    "mark_iteration",
    "step",
    "last_error",
]

_LIB_NAMES = ("libgenpool_torch.so", "libgenpool_torch.dylib")


class GenpoolError(RuntimeError):
    """The genpool library could not be found or loaded, or refused a request."""


class GenpoolInstallError(GenpoolError):
    """genpool could not become PyTorch's allocator (e.g. CUDA was already initialised)."""


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[Path] = None
_allocator: Any = None  # keeps the CUDAPluggableAllocator alive once installed


def _candidates(path: Optional[Union[str, os.PathLike]]) -> list:
    out = []
    if path is not None:
        return [Path(path)]
    env = os.environ.get("GENPOOL_LIB")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    out += [here / n for n in _LIB_NAMES]
    # Bundled by `pip install ./python` (setuptools-rust names it libgenpool_torch<EXT_SUFFIX>).
    out += sorted(p for n in ("libgenpool_torch.*.so", "libgenpool_torch.*.dylib") for p in here.glob(n))
    repo = here.parent.parent
    for profile in ("release", "debug"):
        out += [repo / "target" / profile / n for n in _LIB_NAMES]
    return out


def _declare(lib: ctypes.CDLL) -> None:
    c_size, c_int, c_vp = ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
    sig = {
        "genpool_malloc": ([c_size, c_int, c_vp], c_vp),
        "genpool_free": ([c_vp, c_size, c_int, c_vp], None),
        "genpool_init": ([c_int], None),
        "genpool_reset": ([], None),
        "genpool_set_memory_fraction": ([ctypes.c_double, c_int], None),
        "genpool_record_stream": ([c_vp, c_vp], None),
        "genpool_stats_json": ([c_int, ctypes.c_char_p, c_size], c_size),
        "genpool_trim": ([c_int], ctypes.c_uint64),
        "genpool_mark_iteration": ([c_int], None),
        "genpool_last_error": ([ctypes.c_char_p, c_size], c_size),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


def _load(path: Optional[Union[str, os.PathLike]] = None) -> ctypes.CDLL:
    """Load (once) and return the shared library."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if path is not None and Path(path).resolve() != _lib_path:
                raise GenpoolError(f"genpool already loaded from {_lib_path}, not {path}")
            return _lib
        tried = _candidates(path)
        for cand in tried:
            if cand.is_file():
                try:
                    lib = ctypes.CDLL(str(cand))
                    _declare(lib)
                except (OSError, AttributeError) as e:
                    raise GenpoolError(f"cannot load genpool library {cand}: {e}") from e
                _lib, _lib_path = lib, cand.resolve()
                return lib
        raise GenpoolError(
            "genpool library not found; install the package with its library (`pip install ./python` "
            "from the repository), or build it with `cargo build --release -p genpool-torch` and set "
            "GENPOOL_LIB to the .so. Tried: "
            + ", ".join(str(c) for c in tried)
        )


def library_path() -> Path:
    """Path of the loaded library (loading it if needed)."""
    _load()
    assert _lib_path is not None
    return _lib_path


def _read(fn, *args) -> str:
    """Call an ``snprintf``-style function of the library and return its whole string."""
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(*args, buf, size)
        if n < size:
            return buf.value[:n].decode("utf-8", "replace") if n else ""
        size = n + 1


def last_error() -> str:
    """The library's most recent error message from any thread (``""`` if none)."""
    return _read(_load().genpool_last_error)


def _device_index(device: Any = None) -> int:
    """An int device index from None (current device), an int, a ``torch.device`` or ``"cuda:N"``."""
    if device is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
        return 0
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind == "cuda":
            return int(idx) if idx else _device_index(None)
    elif getattr(device, "type", None) == "cuda":  # a torch.device
        index = getattr(device, "index", None)
        return _device_index(None) if index is None else int(index)
    raise ValueError(f"not a CUDA device: {device!r}")


def raw_stats(device: Any = None) -> Dict[str, Any]:
    """genpool's own statistics for ``device`` (the engine's ``PoolStats`` plus plug-in counters)."""
    d = _device_index(device)
    text = _read(_load().genpool_stats_json, d)
    if not text:
        raise GenpoolError(f"no statistics for device {d}: {last_error()}")
    return json.loads(text)


def memory_stats(device: Any = None) -> "OrderedDict[str, Any]":
    """Statistics under the keys of ``torch.cuda.memory_stats()`` (those genpool can fill), plus every
    genpool figure under ``genpool.*`` (per tier: ``genpool.tier.<name>.<field>``)."""
    s = raw_stats(device)
    allocs, frees = s["num_allocs"], s["num_frees"]
    out: Dict[str, Any] = {
        "allocated_bytes.all.current": s["allocated_current"],
        "allocated_bytes.all.peak": s["allocated_peak"],
        "active_bytes.all.current": s["allocated_current"],
        "active_bytes.all.peak": s["allocated_peak"],
        "reserved_bytes.all.current": s["reserved_current"],
        "reserved_bytes.all.peak": s["reserved_peak"],
        "allocation.all.current": allocs - frees,
        "allocation.all.allocated": allocs,
        "allocation.all.freed": frees,
        "active.all.current": allocs - frees,
        "num_alloc_retries": s["num_alloc_retries"],
        "num_ooms": s["num_ooms"],
    }
    for key, value in s.items():
        if key == "tiers":
            for tier in value:
                for field, v in tier.items():
                    if field != "tier":
                        out[f"genpool.tier.{tier['tier']}.{field}"] = v
        else:
            out[f"genpool.{key}"] = value
    return OrderedDict(sorted(out.items()))


def memory_allocated(device: Any = None) -> int:
    """Bytes in live blocks (``torch.cuda.memory_allocated`` for genpool)."""
    return raw_stats(device)["allocated_current"]


def max_memory_allocated(device: Any = None) -> int:
    """Peak bytes in live blocks."""
    return raw_stats(device)["allocated_peak"]


def memory_reserved(device: Any = None) -> int:
    """Bytes genpool holds from the driver now."""
    return raw_stats(device)["reserved_current"]


def max_memory_reserved(device: Any = None) -> int:
    """Peak bytes genpool held from the driver."""
    return raw_stats(device)["reserved_peak"]


def empty_cache() -> None:
    """Give back everything genpool caches on every device (what ``torch.cuda.empty_cache()`` does once
    genpool is installed)."""
    _load().genpool_reset()


def trim(device: Any = None) -> int:
    """Give back what ``device`` caches; returns the bytes released."""
    return int(_load().genpool_trim(_device_index(device)))


def mark_iteration(device: Any = None) -> None:
    """Tell genpool that a training iteration ended on ``device`` (see :class:`step`)."""
    _load().genpool_mark_iteration(_device_index(device))


class step(contextlib.ContextDecorator):
    """Mark one training iteration: ``with genpool_torch.step(): ...`` or ``@genpool_torch.step()``.
    The iteration is marked on exit (also when the body raises). The engine uses the marks to keep page
    moves within its move budget (``move_budget``, ``page_slack_max``) and, with
    ``experimental.routing:generational``, for the lifetime classifier's position in the iteration."""

    def __init__(self, device: Any = None):
        self.device = device

    def __enter__(self) -> "step":
        return self

    def __exit__(self, *exc) -> bool:
        mark_iteration(self.device)
        return False


def _fn_addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def is_installed() -> bool:
    """True once ``install()`` made genpool PyTorch's allocator in this process."""
    return _mode is not None


_SHIM_SRC = r"""
#include <cstddef>
#include <cstring>
extern "C" {
typedef struct CUstream_st *cudaStream_t;
void *genpool_malloc(size_t size, int device, cudaStream_t stream);
size_t genpool_last_error(char *buf, size_t len);

// PyTorch's CUDAPluggableAllocator does not check alloc_fn's result: a NULL becomes a tensor with a
// null data pointer. Turn genpool's NULL into the exception PyTorch's own allocator would throw.
void *genpool_torch_malloc(size_t size, int device, cudaStream_t stream) {
  void *p = genpool_malloc(size, device, stream);
  if (p == nullptr && size != 0) {
    char msg[2048];
    genpool_last_error(msg, sizeof msg);
    // "invalid size" is a request larger than the device: PyTorch's own allocator calls that OOM too.
    if (std::strncmp(msg, "out of memory", 13) == 0 || std::strncmp(msg, "invalid size", 12) == 0) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (genpool, device ", device, "): ", msg);
    }
    TORCH_CHECK(false, "genpool could not allocate ", size, " bytes on device ", device, ": ", msg);
  }
  return p;
}
}
"""


def _oom_shim(lib_path: Path) -> Path:
    """Compile (once, cached) a tiny C++ wrapper around genpool_malloc that raises
    ``torch.OutOfMemoryError`` instead of returning NULL, and return its path.

    Built with the system C++ compiler (``$GENPOOL_CXX``, default ``c++``; deliberately not ``$CXX``)
    against PyTorch's headers and ``libc10``, linking the C++ runtime dynamically: the exception must be
    thrown by the same ``libstdc++`` PyTorch catches it with. (On the H200 machine ``$CXX`` is a GCC whose
    C++ runtime ends up statically inside the wrapper, also through ``torch.utils.cpp_extension``; its
    exception crashed the process instead of reaching Python.) A wrapper that exports its own
    ``__cxa_throw`` is refused."""
    import hashlib

    import torch

    torch_dir = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    src = "#include <c10/util/Exception.h>\n" + _SHIM_SRC
    key = hashlib.sha1(f"{src}{lib_path}{torch.__version__}{abi}".encode()).hexdigest()[:12]
    out_dir = Path(os.environ.get("GENPOOL_SHIM_DIR", Path.home() / ".cache" / "genpool_torch"))
    so = out_dir / f"genpool_torch_shim_{key}.so"
    if so.is_file():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    cpp = out_dir / f"genpool_torch_shim_{key}.cpp"
    cpp.write_text(src)
    tmp = out_dir / f"genpool_torch_shim_{key}.{os.getpid()}.tmp"
    cmd = [
        os.environ.get("GENPOOL_CXX", "c++"), "-O2", "-shared", "-fPIC", "-std=c++17",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}", str(cpp), "-o", str(tmp),
        str(lib_path), f"-L{torch_dir / 'lib'}", "-lc10",
        f"-Wl,-rpath,{torch_dir / 'lib'}", f"-Wl,-rpath,{lib_path.parent}",
    ]
    from .backend import compile_cached

    return compile_cached(cmd, tmp, so, "the wrapper", GenpoolError)


_FALLBACK_LIMITS = (
    "torch.cuda.memory_stats() and friends, torch.accelerator's memory figures, cudnn.benchmark, memory "
    "snapshots, the profiler's memory events, CUDA graphs and MemPool will not work"
)
_mode: Optional[str] = None  # "allocator" or "pluggable" once installed


def active_backend() -> Optional[str]:
    """How genpool is PyTorch's allocator in this process: ``"allocator"`` (the C++ backend, PyTorch's
    whole allocator interface), ``"pluggable"`` (the ``CUDAPluggableAllocator`` fallback), or ``None``."""
    return _mode


def install(path: Optional[Union[str, os.PathLike]] = None, *, device: Optional[str] = None,
            config: Optional[str] = None, oom: str = "raise", backend: Optional[str] = None):
    """Make genpool PyTorch's CUDA allocator. Call it before CUDA is initialised (before the first CUDA
    tensor, ``torch.cuda.current_device()`` or ``torch.cuda.memory_allocated()``).

    ``device`` sets ``GENPOOL_DEVICE`` (``"cuda"``, the default, ``"sim"`` or ``"auto"``) and ``config``
    sets ``GENPOOL_CONF`` (``"key:value,..."``) for the pools, which are created on each device's first
    allocation.

    ``backend="auto"`` (default) installs genpool's C++ backend, a ``CUDAAllocator`` of its own built
    against this torch on first use (seconds, then cached; see ``genpool_torch.backend``): every
    ``torch.cuda`` memory function, ``cudnn.benchmark``, memory history and snapshots, the profiler, OOM
    observers, CUDA graphs and MemPools work as with PyTorch's own allocator. Where it cannot be built
    (no C++ compiler, a torch older than 2.11) ``"auto"`` falls back to PyTorch's
    ``CUDAPluggableAllocator`` and says once what will not work; ``backend="allocator"`` raises instead,
    ``backend="pluggable"`` asks for the fallback; ``None`` takes ``$GENPOOL_TORCH_BACKEND`` (default
    ``"auto"``). Returns ``active_backend()``'s value.

    ``oom`` applies to the pluggable fallback only: ``"raise"`` compiles a small wrapper so that
    allocations genpool cannot serve raise ``torch.OutOfMemoryError``; ``"null"`` (no compiler needed)
    lets them yield a tensor with a null data pointer.
    """
    if oom not in ("raise", "null"):
        raise ValueError(f"oom must be 'raise' or 'null', not {oom!r}")
    if backend is None:
        backend = os.environ.get("GENPOOL_TORCH_BACKEND", "auto")
    if backend not in ("auto", "allocator", "pluggable"):
        raise ValueError(f"backend must be 'auto', 'allocator' or 'pluggable', not {backend!r}")
    global _allocator, _mode
    if _mode is not None:
        return _mode
    try:
        import torch
    except ImportError as e:
        raise GenpoolInstallError(
            f"genpool_torch.install() needs PyTorch, which is not installed here ({e}): "
            "pip install torch (a CUDA build); the statistics helpers work without it"
        ) from e
    if torch.cuda.is_initialized():
        try:
            held = f"{torch.cuda.memory_allocated()} bytes allocated by the current allocator"
        except Exception:  # a pluggable allocator has no device stats
            held = "another allocator is active"
        raise GenpoolInstallError(
            f"CUDA is already initialised ({held}): call genpool_torch.install() before any CUDA use, "
            "e.g. at the top of the program"
        )
    if device is not None:
        os.environ["GENPOOL_DEVICE"] = device
    if config is not None:
        os.environ["GENPOOL_CONF"] = config
    lib = _load(path)
    assert _lib_path is not None
    if backend in ("auto", "allocator"):
        from . import backend as _backend_mod

        try:
            _backend_mod.install(_lib_path)
            _mode = "allocator"
            return _mode
        except _backend_mod.BackendError as e:
            if backend == "allocator":
                raise GenpoolInstallError(f"genpool's PyTorch backend: {e}") from e
            import warnings

            warnings.warn(
                f"genpool: the C++ backend is unavailable ({str(e).splitlines()[0]}); using PyTorch's "
                f"CUDAPluggableAllocator instead: {_FALLBACK_LIMITS}",
                RuntimeWarning,
                stacklevel=2,
            )
    _allocator = _install_pluggable(torch, lib, oom)
    _mode = "pluggable"
    return _mode


def _install_pluggable(torch, lib, oom: str):
    """The fallback: genpool's C hooks behind ``torch.cuda.memory.CUDAPluggableAllocator``."""
    assert _lib_path is not None
    so_path, malloc_name = _lib_path, "genpool_malloc"
    if oom == "raise":
        try:
            so_path, malloc_name = _oom_shim(_lib_path), "genpool_torch_malloc"
        except Exception as e:
            raise GenpoolInstallError(
                f"cannot build the out-of-memory wrapper ({e}); install a C++ compiler, or pass "
                "oom='null' to accept null tensors on out-of-memory"
            ) from e
    # genpool_free resolves through the wrapper's dependency on the library.
    alloc = torch.cuda.memory.CUDAPluggableAllocator(str(so_path), malloc_name, "genpool_free")
    raw = alloc.allocator()
    # Only the callbacks PyTorch's C++ side calls (CUDAPluggableAllocator.cpp): init at CUDA
    # initialisation, reset from torch.cuda.empty_cache(), the memory fraction from
    # torch.cuda.set_per_process_memory_fraction(), record_stream from Tensor.record_stream().
    raw.set_init_fn(_fn_addr(lib.genpool_init))
    raw.set_reset_fn(_fn_addr(lib.genpool_reset))
    raw.set_memory_fraction_fn(_fn_addr(lib.genpool_set_memory_fraction))
    raw.set_record_stream_fn(_fn_addr(lib.genpool_record_stream))
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise GenpoolInstallError(
            f"PyTorch refused to switch allocators ({e}); call genpool_torch.install() before any CUDA use"
        ) from e
    return alloc
from .sleep import GenpoolSleepError, current_tag, region, sleep, sleeping, tags_info, wake  # noqa: E402,F401
__all__ += ["GenpoolSleepError", "region", "sleep", "wake", "sleeping", "tags_info", "current_tag"]
