"""Give GPU memory back without giving up addresses: tagged regions, sleep / wake, offload.

Reinforcement-learning fine-tuning runs a trainer and a rollout engine on the same GPUs and hands the
memory back and forth every iteration. genpool keeps address space apart from physical pages, so it can
release a tag's physical memory to the driver while every tensor keeps its pointer::

    import genpool_torch as gt
    with gt.region("weights"):
        model = build_model().cuda()          # tagged "weights"
    with gt.region("kv_cache"):
        kv = torch.empty(n, device="cuda")    # tagged "kv_cache"
    gt.sleep(["weights", "kv_cache"], offload=True)   # physical memory back to the driver
    ...                                       # another process / engine uses the GPU
    gt.wake(["weights", "kv_cache"])          # same addresses, weights restored bit for bit

- ``region(tag)`` tags what the calling thread allocates inside it (tags are per thread: allocations made
  by PyTorch's autograd worker threads, i.e. most of a backward pass, are untagged). Untagged memory is
  the tag ``"default"``. Each tag is its own genpool engine per device, so a tag's pages never hold
  another tag's memory.
- ``sleep(tags=None, offload=False)``: every physical page held for those tags (``None``: every tag,
  ``"default"`` included) is unmapped and released, after its contents are copied to pinned host memory
  with ``offload=True``. Without offload the contents are lost (they come back undefined). Nothing of it
  stays cached: the driver has it back (NVML shows it free) and another process can allocate it.
- While a tag sleeps, allocating under it raises (``torch.OutOfMemoryError`` through the plug-in, whose
  message says the pool is asleep); freeing its tensors is fine; **a kernel touching its memory faults**
  (an illegal-address error that poisons the CUDA context) — do not touch sleeping tensors.
- ``wake(tags=None)`` maps the memory again at the same addresses and restores what was offloaded. If
  another process still holds the memory, it raises ``GenpoolSleepError`` (code ``ERR_OUT_OF_MEMORY``)
  and the tags stay asleep: call it again later.
- Errors (``GenpoolSleepError``, with ``.code``): an unknown tag, a double sleep, a wake without sleep,
  either call during a CUDA graph capture. ``sleep`` and ``wake`` synchronize the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import sys
import threading
from typing import Any, Dict, Iterable, Iterator, List, Optional, Union

from . import GenpoolError, _load, _read, last_error

__all__ = [
    "GenpoolSleepError",
    "region",
    "sleep",
    "wake",
    "sleeping",
    "tags_info",
    "current_tag",
]

SLEEP_OFFLOAD = 1
SLEEP_CAPTURING = 2

ERR_INVALID = -1
ERR_UNKNOWN_TAG = -2
ERR_ASLEEP = -3
ERR_NOT_ASLEEP = -4
ERR_CAPTURING = -5
ERR_OUT_OF_MEMORY = -6
ERR_FAILED = -7

DEFAULT_TAG = "default"


class GenpoolSleepError(GenpoolError):
    """A tag, sleep or wake call was refused or failed; ``code`` is the library's ``GENPOOL_ERR_*``."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


_declare_lock = threading.Lock()
_declared = False
_local = threading.local()


def _lib() -> ctypes.CDLL:
    global _declared
    lib = _load()
    with _declare_lock:
        if not _declared:
            c_int, c_char_p, c_size = ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t
            lib.genpool_tag_set.argtypes, lib.genpool_tag_set.restype = [c_char_p], c_int
            lib.genpool_sleep.argtypes, lib.genpool_sleep.restype = [c_char_p, c_int], c_int
            lib.genpool_wake.argtypes, lib.genpool_wake.restype = [c_char_p, c_int], c_int
            lib.genpool_tags_json.argtypes, lib.genpool_tags_json.restype = [c_char_p, c_size], c_size
            _declared = True
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise GenpoolSleepError(f"{what}: {last_error()}", rc)


def _name(tag: Any) -> str:
    if not isinstance(tag, str):
        raise TypeError(f"a tag is a str, not {type(tag).__name__}")
    if not tag or "," in tag:
        raise ValueError(f"bad tag {tag!r}: a non-empty name with no comma")
    return tag


def _csv(tags: Union[None, str, Iterable[str]]) -> Optional[bytes]:
    if tags is None:
        return None
    names = [_name(tags)] if isinstance(tags, str) else [_name(t) for t in tags]
    if not names:
        raise ValueError("an empty list of tags (pass None for every tag)")
    return ",".join(names).encode()


def _capturing() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized()
                    and torch.cuda.is_current_stream_capturing())
    except Exception:  # a stand-in torch, or no CUDA
        return False


def current_tag() -> str:
    """The calling thread's tag (``"default"`` outside every ``region``)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else DEFAULT_TAG


@contextlib.contextmanager
def region(tag: str) -> Iterator[str]:
    """Tag what the calling thread allocates inside the block (nestable; the outer tag comes back)."""
    name = _name(tag)
    lib = _lib()
    outer = current_tag()
    _check(lib.genpool_tag_set(name.encode()), f"region({name!r})")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(name)
    try:
        yield name
    finally:
        stack.pop()
        _check(lib.genpool_tag_set(outer.encode()), f"region({name!r}) exit")


def sleep(tags: Union[None, str, Iterable[str]] = None, offload: bool = False) -> None:
    """Release the physical memory of ``tags`` (``None``: every tag) keeping every address; with
    ``offload`` their contents are kept in pinned host memory for ``wake``."""
    flags = (SLEEP_OFFLOAD if offload else 0) | (SLEEP_CAPTURING if _capturing() else 0)
    _check(_lib().genpool_sleep(_csv(tags), flags), f"sleep({tags!r})")


def wake(tags: Union[None, str, Iterable[str]] = None) -> None:
    """Map the memory of ``tags`` (``None``: every tag) again at the same addresses and restore what was
    offloaded."""
    flags = SLEEP_CAPTURING if _capturing() else 0
    _check(_lib().genpool_wake(_csv(tags), flags), f"wake({tags!r})")


def tags_info() -> Dict[str, Any]:
    """Every tag: whether it sleeps and, per device, its allocated / reserved / sleeping / offloaded bytes."""
    return json.loads(_read(_lib().genpool_tags_json))


def sleeping() -> List[str]:
    """The tags asleep now."""
    return [t["name"] for t in tags_info()["tags"] if t["asleep"]]
