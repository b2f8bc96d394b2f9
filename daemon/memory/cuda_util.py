"""Shared helpers for the CUDA memory backends (cuda_vmm, cuda_ipc).

`cuda.bindings.driver` is imported lazily, so importing the backends works on machines
without a GPU or driver; constructing a backend there fails with a message that names the
CPU backend instead. Driver calls go through `check`, which turns a CUresult into a
`CudaError` naming the call and the driver's error string.

Raw device memory (VMM mappings, legacy IPC mappings, cuMemAlloc blocks) reaches torch as a
uint8 CUDA tensor through `__cuda_array_interface__` (it has no typestr for bf16 or fp8;
callers `.view(dtype)` the bytes). torch keeps the wrapped object alive for as long as any
tensor shares the storage, so the object's finalizer — unmap, release, close — runs only
after the last view is gone.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from resident.daemon.memory.base import Slab, SlabDesc

log = logging.getLogger(__name__)

GiB = 1 << 30


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


class CudaUnavailable(RuntimeError):
    """No usable NVIDIA GPU / driver in this process."""


class DeviceMismatch(ValueError):
    """A slab lives on another GPU than the one this process uses."""


def driver() -> Any:
    """The `cuda.bindings.driver` module (imported on first use)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError as e:  # cuda-python missing from this environment
        raise CudaUnavailable(
            f"cuda-python (cuda.bindings) is not importable: {e}; install cuda-python>=12.6 "
            "or use --backend host_shm"
        ) from None
    return drv


def check(call: str, result: Any) -> Any:
    """Unpack a cuda-bindings result tuple `(CUresult, *values)`, raising on failure.

    Returns None, the single value, or a tuple of values.
    """
    drv = driver()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{call} failed: {error_text(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def error_text(err: Any) -> str:
    drv = driver()
    name, text = str(err), ""
    try:
        e1, n = drv.cuGetErrorName(err)
        if e1 == drv.CUresult.CUDA_SUCCESS and n:
            name = n.decode() if isinstance(n, bytes) else str(n)
        e2, s = drv.cuGetErrorString(err)
        if e2 == drv.CUresult.CUDA_SUCCESS and s:
            text = s.decode() if isinstance(s, bytes) else str(s)
    except Exception:  # noqa: BLE001 - describing an error must not raise another
        pass
    return f"{name} ({text})" if text else name


def require_cuda(backend: str) -> None:
    """Fail clearly unless this process can use an NVIDIA GPU through the driver API."""
    hint = f"{backend} needs an NVIDIA GPU with a driver; use --backend host_shm"
    try:
        drv = driver()
    except CudaUnavailable as e:
        raise CudaUnavailable(f"{hint} ({e})") from None
    try:
        err = drv.cuInit(0)
        err = err[0] if isinstance(err, tuple) else err
    except Exception as e:  # noqa: BLE001 - cuda-bindings raises when libcuda.so is absent
        raise CudaUnavailable(f"{hint} (driver library not found: {e})") from None
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaUnavailable(f"{hint} (cuInit: {error_text(err)})")
    count = check("cuDeviceGetCount", drv.cuDeviceGetCount())
    if count < 1:
        raise CudaUnavailable(f"{hint} (the driver sees no GPU; check CUDA_VISIBLE_DEVICES)")


def device_index(device: int | str) -> int:
    """`0`, `"cuda"`, `"cuda:1"` or `"1"` → the device ordinal in this process."""
    if isinstance(device, torch.device):
        device = str(device)
    if isinstance(device, int):
        index = device
    else:
        text = str(device).strip()
        if text == "cuda":
            index = 0
        elif text.startswith("cuda:"):
            text = text[len("cuda:"):]
            index = int(text) if text.isdigit() else -1
        else:
            index = int(text) if text.isdigit() else -1
        if index < 0:
            raise ValueError(f"invalid CUDA device {device!r}; expected an index or 'cuda:N'")
    if index < 0:
        raise ValueError(f"invalid CUDA device {device!r}; expected an index >= 0")
    return index


def ensure_context(index: int) -> None:
    """Make device `index`'s primary context current on this thread.

    torch's CUDA runtime uses the same primary context, so driver-API allocations and
    torch kernels agree. The primary context is retained for the rest of the process (as
    the runtime itself does); nothing is retained when it is already current.
    """
    drv = driver()
    check("cuInit", drv.cuInit(0))
    dev = check("cuDeviceGet", drv.cuDeviceGet(index))
    current = check("cuCtxGetCurrent", drv.cuCtxGetCurrent())
    if current is not None and int(current) != 0:
        if int(check("cuCtxGetDevice", drv.cuCtxGetDevice())) == int(dev):
            return
    ctx = check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
    check("cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))


def device_uuid(index: int) -> str:
    """The GPU's UUID in nvidia-smi's spelling (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)."""
    drv = driver()
    dev = check("cuDeviceGet", drv.cuDeviceGet(index))
    uuid = check("cuDeviceGetUuid", drv.cuDeviceGetUuid(dev))
    raw = ctypes.string_at(uuid.getPtr(), 16)  # the struct's 16 bytes, whatever `.bytes` returns
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def index_of_uuid(uuid: str) -> int | None:
    """This process's ordinal of the GPU with `uuid`, or None when it is not visible."""
    drv = driver()
    for i in range(check("cuDeviceGetCount", drv.cuDeviceGetCount())):
        if device_uuid(i) == uuid:
            return i
    return None


def importing_device(slab_uuid: str, backend: str) -> int:
    """The device a client maps a slab onto: torch's current device, whose UUID must match."""
    require_cuda(backend)
    torch.cuda.init()
    index = torch.cuda.current_device()
    ensure_context(index)
    here = device_uuid(index)
    if slab_uuid and here != slab_uuid:
        other = index_of_uuid(slab_uuid)
        fix = (
            f"that GPU is visible here as cuda:{other}; call torch.cuda.set_device({other})"
            if other is not None
            else "that GPU is not visible to this process"
        )
        raise DeviceMismatch(
            f"slab lives on GPU {slab_uuid}, this process uses {here} (cuda:{index}); {fix}, "
            "or set CUDA_VISIBLE_DEVICES so the worker runs on the daemon's GPU for this model"
        )
    return index


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def backend_device(backend: str, device: int | str, max_slab_bytes: int) -> int:
    """The ordinal of `device` for a GPU backend's constructor, after checking that a GPU
    with a driver is there, that the device exists and that the slab limit is positive."""
    require_cuda(backend)
    index = device_index(device)
    count = int(check("cuDeviceGetCount", driver().cuDeviceGetCount()))
    if index >= count:
        raise ValueError(f"{backend}: GPU cuda:{index} does not exist; this process sees {count} GPU(s)")
    if max_slab_bytes <= 0:
        raise ValueError(f"{backend}: max_slab_bytes must be positive, got {max_slab_bytes}")
    return index


def pinned_device_prop(index: int, export_fd: bool = False) -> Any:
    """cuMemCreate properties: pinned memory on device `index`, exportable as a POSIX fd when
    `export_fd` (the daemon's slabs) or private (a worker's KV cache)."""
    drv = driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    if export_fd:
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def vmm_granularity(index: int, export_fd: bool = False) -> int:
    """The recommended VMM allocation granularity for `pinned_device_prop(index, export_fd)`
    (2 MiB on an H200)."""
    drv = driver()
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(check("cuMemGetAllocationGranularity",
                     drv.cuMemGetAllocationGranularity(pinned_device_prop(index, export_fd), flag)))


class DeviceBuffer:
    """Owner of `nbytes` of raw device memory at `ptr`; exposes `__cuda_array_interface__`.

    `release(ptr)` runs once — on `close()` or when the object is collected — with the
    device's context made current first. It must not raise (errors are logged).
    """

    def __init__(self, ptr: int, nbytes: int, device: int, release: Callable[[], None], what: str) -> None:
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.device = device
        self.what = what
        self._finalizer = weakref.finalize(self, _run_release, device, release, what)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
        }

    def tensor(self) -> torch.Tensor:
        """A uint8 CUDA tensor over the whole buffer; it keeps this object alive."""
        t = torch.as_tensor(self, device=torch.device("cuda", self.device))
        if t.data_ptr() != self.ptr or t.numel() != self.nbytes:
            raise CudaError(f"torch wrapped {self.what} at the wrong address or size")
        return t

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Release now. Only safe when no tensor over the buffer is used any more."""
        self._finalizer()


#: Buffers collected while a CUDA graph is captured in this process, released when the last capture ends:
#: the release's cuCtxSynchronize (or unmap) inside a capture would invalidate it (global capture mode).
_captures = 0
_deferred: list[tuple[int, Callable[[], None], str]] = []
_deferred_lock = threading.Lock()


@contextmanager
def releases_deferred() -> Iterator[None]:
    """Held around a CUDA graph capture: a DeviceBuffer collected meanwhile (a garbage collection the
    capture's own allocations set off, or another thread's) is released after the capture, not inside it."""
    global _captures
    with _deferred_lock:
        _captures += 1
    try:
        yield
    finally:
        with _deferred_lock:
            _captures -= 1
            due = list(_deferred) if _captures == 0 else []
            if due:
                _deferred.clear()
        for args in due:
            _release_now(*args)


def _run_release(device: int, release: Callable[[], None], what: str) -> None:
    with _deferred_lock:
        if _captures:
            _deferred.append((device, release, what))
            log.debug("%s collected during a CUDA graph capture: released after it", what)
            return
    _release_now(device, release, what)


def _release_now(device: int, release: Callable[[], None], what: str) -> None:
    try:
        ensure_context(device)
        # Work queued on any stream may still read the memory; wait for it before unmapping.
        best_effort("cuCtxSynchronize", driver().cuCtxSynchronize())
        release()
    except Exception as e:  # noqa: BLE001 - finalizers must not raise (they may run at exit)
        log.debug("releasing %s failed: %s", what, e)


def best_effort(call: str, result: Any) -> None:
    """Check a cleanup call's result, logging instead of raising."""
    try:
        check(call, result)
    except CudaError as e:
        log.warning("%s", e)


def synchronize(index: int) -> None:
    """Wait for all work queued on device `index` (e.g. the loader's H2D copies)."""
    ensure_context(index)
    check("cuCtxSynchronize", driver().cuCtxSynchronize())


class DeviceSlab(Slab):
    """Daemon-side state shared by GPU slabs: fill through `writable()`, `seal()`, read, close.

    `close()` drops the daemon's references; the memory is unmapped when the last tensor
    over it goes (at once when the daemon kept no view), so no view ever points at unmapped
    memory. Clients' mappings are independent of the daemon's.
    """

    def __init__(self, desc: SlabDesc, buffer: DeviceBuffer) -> None:
        self.desc = desc
        self._buffer: DeviceBuffer | None = buffer
        self._tensor: torch.Tensor | None = None
        self._sealed = False

    @property
    def device_index(self) -> int:
        return self._live().device

    @property
    def sealed(self) -> bool:
        return self._sealed

    def _live(self) -> DeviceBuffer:
        if self._buffer is None:
            raise RuntimeError(f"{self.desc.backend} slab {self.desc.index} is closed")
        return self._buffer

    def _view(self) -> torch.Tensor:
        buffer = self._live()
        if self._tensor is None:
            self._tensor = buffer.tensor()
        return self._tensor

    def writable(self) -> torch.Tensor:
        if self._sealed:
            raise RuntimeError(
                f"{self.desc.backend} slab {self.desc.index} is sealed; writable() is only valid before seal()"
            )
        return self._view()

    def readable(self) -> torch.Tensor:
        return self._view()

    def seal(self) -> None:
        if self._sealed:
            return
        buffer = self._live()
        # The loader's copies may still be in flight on its streams.
        synchronize(buffer.device)
        self._protect(buffer)
        self._sealed = True

    def _protect(self, buffer: DeviceBuffer) -> None:
        """Make the daemon's own mapping read-only where the backend can (after seal)."""

    def close(self) -> None:
        self._tensor = None
        self._buffer = None
