"""Calling exported kernels through the TVM-FFI C ABI with ctypes: no ``tvm_ffi`` Python package.

Every compiled kernel is a linked ``.so`` exporting ``__tvm_ffi_<function name>``, a TVM-FFI "safe
call" (``int fn(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result)``) that
reads tensors as ``DLTensor*`` and takes its CUDA stream from ``TVMFFIEnvGetStream``. Importing
the ``tvm_ffi`` package costs tens of milliseconds (its extension module, reflection tables and
optional torch add-ons) and a few microseconds per call (a Python object per argument); the ABI
itself needs neither. This module loads ``libtvm_ffi.so`` (which the kernels link against) and the
kernel ``.so`` with ctypes, lays the arguments out in one buffer per call (``DLTensor`` structs
included), sets the environment stream to torch's current stream for the call, and turns an error
the kernel raised into the matching Python exception (``ValueError``, ``TypeError``, ...) with the
kernel's message.

:func:`load_library` loads a kernel file after the DSL runtime library it was linked against
(found in the installed DSL wheel: a kernel names only its flavour), from the sealed in-memory copy
its checksum was computed over (:class:`cutefa.identity.KernelFile`);
:class:`WithSmCount` calls a persistent kernel, whose entry also takes the GPU's SM count.

:meth:`Function.bind` goes further for one call signature that repeats: the buffer is laid out
once (shapes, strides, dtypes, device and scalars fixed) and each call only writes the data
pointers. Calls keep the GIL (``ctypes.PyDLL``): they take microseconds, and releasing and
re-acquiring the GIL would cost a good part of that.

The layouts below are the TVM-FFI C ABI (``tvm/ffi/c_api.h``) and DLPack's (``dlpack.h``)::

    TVMFFIAny   { int32 type_index; uint32 padding; 8-byte value }                   16 bytes
    DLTensor    { void* data; int32 device_type, device_id; int32 ndim;
                  uint8 code, bits; uint16 lanes; int64* shape; int64* strides; uint64 byte_offset }
                                                                                      48 bytes
    TVMFFIObject{ uint64 ref counts; int32 type_index; uint32 pad; void* deleter }   24 bytes
    error cell  { (char*, size_t) kind, message, backtrace; ... } right after the object header
"""

from __future__ import annotations

import builtins
import ctypes
import importlib.util
import logging
import os
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cutefa import profile
from cutefa.identity import DSL_DIST, RUNTIME_FLAVOUR, KernelFile

log = logging.getLogger("cutefa")

# TVMFFIAny type indices
_K_NONE, _K_INT, _K_BOOL, _K_FLOAT, _K_DLTENSOR_PTR = 0, 1, 2, 3, 7
# DLPack device types
_DL_CPU, _DL_CUDA = 1, 2
_ANY_SIZE, _DLTENSOR_SIZE, _OBJECT_HEADER = 16, 48, 24

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_LIBRARIES: dict[Path, ctypes.CDLL] = {}  # kernel file -> its library
_DIGESTS: dict[Path, str] = {}  # kernel file -> the sha256 of the bytes loaded for it
_HELD: list[KernelFile | int] = []  # descriptors that name loaded libraries: open for good
_DSL_RUNTIMES: dict[Path, ctypes.CDLL] = {}


def _dtype_codes() -> dict[Any, tuple[int, int]]:
    import torch

    codes = {
        torch.float16: (2, 16),
        torch.float32: (2, 32),
        torch.float64: (2, 64),
        torch.bfloat16: (4, 16),
        torch.int8: (0, 8),
        torch.int16: (0, 16),
        torch.int32: (0, 32),
        torch.int64: (0, 64),
        torch.uint8: (1, 8),
        torch.bool: (6, 8),
    }
    for name, code in (("float8_e4m3fn", 10), ("float8_e5m2", 12)):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            codes[dtype] = (code, 8)
    return codes


_DTYPES: dict[Any, tuple[int, int]] = {}


def tvm_ffi_library_path() -> Path:
    """``libtvm_ffi.so`` of the installed ``apache-tvm-ffi``, found without importing the package."""
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the apache-tvm-ffi package (a dependency of nvidia-cutlass-dsl) is not installed")
    for base in spec.submodule_search_locations:
        path = Path(base) / "lib" / "libtvm_ffi.so"
        if path.is_file():
            return path
    raise RuntimeError(
        f"apache-tvm-ffi has no lib/libtvm_ffi.so under {list(spec.submodule_search_locations)}"
    )


def runtime() -> ctypes.CDLL:
    """``libtvm_ffi.so``, loaded once with global symbols (the kernels resolve theirs against it)."""
    global _LIB
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                # PyDLL: calls keep the GIL (no release and re-acquire around microsecond calls)
                lib = ctypes.PyDLL(str(tvm_ffi_library_path()), mode=ctypes.RTLD_GLOBAL)
                lib.TVMFFIEnvGetStream.restype = ctypes.c_void_p  # (int32 device type, int32 id): no argtypes
                lib.TVMFFIEnvSetStream.restype = ctypes.c_int
                lib.TVMFFIEnvSetStream.argtypes = [
                    ctypes.c_int32,
                    ctypes.c_int32,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                ]
                lib.TVMFFIErrorMoveFromRaised.restype = None
                lib.TVMFFIErrorMoveFromRaised.argtypes = [ctypes.c_void_p]
                lib.TVMFFIObjectDecRef.restype = ctypes.c_int
                lib.TVMFFIObjectDecRef.argtypes = [ctypes.c_void_p]
                _LIB = lib
    return _LIB


class KernelLoadError(RuntimeError):
    """A kernel file the dynamic loader refuses (not a shared object, truncated, missing symbols) or
    that exports no entry of the expected name."""


def load(path: Path | str | KernelFile, function_name: str) -> Function:
    """The exported function ``function_name`` of the linked kernel library at ``path``, or of a
    checked :class:`cutefa.identity.KernelFile` (what it holds is loaded: the bytes checked).
    Raises :class:`KernelLoadError` when the dynamic loader refuses the file or it has no such entry."""
    rt = runtime()
    kernel = path if isinstance(path, KernelFile) else KernelFile(path)
    with _LOCK:
        lib = _LIBRARIES.get(kernel.path)
        if lib is None or _DIGESTS[kernel.path] != kernel.sha256:
            lib = _LIBRARIES[kernel.path] = _dlopen(kernel)
            _DIGESTS[kernel.path] = kernel.sha256
    try:
        symbol = getattr(lib, f"__tvm_ffi_{function_name}")
    except AttributeError:
        raise KernelLoadError(f"{kernel.path} exports no TVM-FFI function {function_name!r}") from None
    # No argtypes: every call passes (None, a ctypes buffer, a small int, a ctypes buffer), which
    # ctypes converts to (NULL, its address, int32, its address) without a conversion table.
    symbol.restype = ctypes.c_int
    return Function(symbol, function_name, rt)


def _dlopen(kernel: KernelFile) -> ctypes.CDLL:
    """dlopen what ``kernel`` holds open (its checked in-memory copy) as ``/proc/self/fd/N``. The
    dynamic loader knows a library by the name it was opened with, so that descriptor stays open for
    good (a later file opened under a reused number would be taken for this one), and a number some
    other code already opened a library under is not used. Without ``/proc``, the path (checked a
    moment ago) is loaded."""
    name = str(kernel.path)
    if os.path.isdir("/proc/self/fd"):
        for _ in range(8):
            name = f"/proc/self/fd/{kernel.fd}"
            try:
                ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
            except OSError:
                break  # no library loaded under this name: it is ours
            previous, kernel.fd = kernel.fd, os.dup(kernel.fd)
            _HELD.append(previous)  # closing it would free the number for a third file
    try:
        lib = ctypes.PyDLL(name)
    except OSError as exc:
        raise KernelLoadError(str(exc).replace(name, str(kernel.path))) from None
    _HELD.append(kernel)
    return lib


def installed_runtimes() -> dict[str, Path]:
    """flavour (e.g. 'cu12') -> ``libcute_dsl_runtime.so`` of each flavour the installed DSL wheel has."""
    import nvidia_cutlass_dsl

    found: dict[str, Path] = {}
    for base in nvidia_cutlass_dsl.__path__:
        for path in sorted(Path(base).glob("*/lib/libcute_dsl_runtime.so")):
            if RUNTIME_FLAVOUR.fullmatch(path.parent.parent.name):
                found.setdefault(path.parent.parent.name, path)
    return found


def runtime_library(flavour: str) -> Path:
    """``libcute_dsl_runtime.so`` of the installed DSL wheel for ``flavour`` (e.g. 'cu12'): a token
    matching :data:`cutefa.identity.RUNTIME_FLAVOUR`, never a path."""
    if not RUNTIME_FLAVOUR.fullmatch(flavour):
        raise ValueError(f"DSL runtime flavour {flavour!r} is not one (cu12, cu13, ...)")
    path = installed_runtimes().get(flavour)
    if path is None:
        raise RuntimeError(f"the installed {DSL_DIST} has no {flavour}/lib/libcute_dsl_runtime.so")
    return path


def _runtime_for(flavour: str) -> Path:
    """The DSL runtime to load for a kernel linked against ``flavour``; another flavour of the same
    DSL version when that one is not installed (a kernel names the runtime by soname only, and the
    flavours export one ABI: a cu12-linked kernel was seen running on a cu13 runtime). Only the
    installed DSL's libraries are candidates: a kernel's ``runtime`` is a token, never a path."""
    try:
        return runtime_library(flavour)
    except RuntimeError:
        for other, path in installed_runtimes().items():
            log.debug("cutefa: no %s DSL runtime installed; using %s's %s", flavour, other, path)
            return path
        raise


def load_library(so_path: Path | KernelFile, function_name: str, runtime: str) -> Function:
    """Load a linked kernel (a checked :class:`cutefa.identity.KernelFile`, or a path) after the DSL
    runtime library it was linked against (flavour ``runtime``, e.g. 'cu12') and return its function
    (the ``tvm_ffi`` package is not imported). Raises :class:`KernelLoadError` when the kernel file
    does not load."""
    with profile.phase("DSL runtime library (find, dlopen)"):
        lib = _runtime_for(runtime)
        with _LOCK:
            if lib not in _DSL_RUNTIMES:
                _DSL_RUNTIMES[lib] = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    with profile.phase("kernel library (dlopen libtvm_ffi and the kernel)"):
        return load(so_path, function_name)


class WithSmCount:
    """``fn(q, k, v, o, lse, softmax_scale)`` (the fp8 forward: with its three descales before the
    scale) for a persistent kernel, whose compiled entry also takes the number of CTAs to launch:
    the SM count of q's GPU (looked up once per device), appended as the last argument."""

    __slots__ = ("_counts", "fn")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._counts: dict[int, int] = {}

    def sms(self, device: int) -> int:
        sms = self._counts.get(device)
        if sms is None:
            import torch

            # Tensors not on a GPU (device -1) get 1: the kernel's own checks then refuse them.
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device >= 0 else 1
            self._counts[device] = sms
        return sms

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args, self.sms(args[0].get_device()))

    def bind(self, args: Sequence[Any], tensor_slots: Sequence[int]) -> Any:
        """:meth:`Function.bind` of the kernel with the SM count appended (AttributeError when the
        kernel has none: a DSL object kept in memory, not loaded from a file)."""
        return self.fn.bind([*args, self.sms(args[0].get_device())], tensor_slots)


def _raise_error(rt: ctypes.CDLL, name: str) -> None:
    """Fetch the error the kernel raised (TVMFFIErrorMoveFromRaised) and raise it in Python."""
    handle = ctypes.c_void_p()
    rt.TVMFFIErrorMoveFromRaised(ctypes.byref(handle))
    if not handle.value:
        raise RuntimeError(f"{name}: the kernel call failed without an error message")
    try:
        cell = handle.value + _OBJECT_HEADER
        kind_ptr, kind_len, msg_ptr, msg_len = struct.unpack("<QQQQ", ctypes.string_at(cell, 32))
        kind = ctypes.string_at(kind_ptr, kind_len).decode("utf-8", "replace") if kind_ptr else "RuntimeError"
        message = ctypes.string_at(msg_ptr, msg_len).decode("utf-8", "replace") if msg_ptr else ""
    finally:
        rt.TVMFFIObjectDecRef(handle)
    cls = getattr(builtins, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
        message = f"{kind}: {message}"
    raise cls(message)


class _Layout:
    """The buffer of one argument signature (a tuple: ndim per tensor, 'f'/'i'/'b'/'n' per scalar):
    the TVMFFIAny array, then per tensor a DLTensor followed by its shape and strides."""

    __slots__ = ("size", "struct", "tensor_at")

    def __init__(self, key: tuple[Any, ...]) -> None:
        value = {"f": "d", "i": "q", "b": "q", "n": "q"}
        fmt = "<" + "".join("iIQ" if k.__class__ is int else "iI" + value[k] for k in key)
        at, tensor_at = _ANY_SIZE * len(key), []
        for k in key:
            tensor_at.append(at)
            if k.__class__ is int:
                fmt += "QiiiBBHQQQ" + f"{2 * k}q"
                at += _DLTENSOR_SIZE + 16 * k
        self.struct = struct.Struct(fmt)
        assert self.struct.size == at
        self.size = at
        self.tensor_at = tuple(tensor_at)


_LAYOUTS: dict[tuple[Any, ...], _Layout] = {}
_TENSOR_TYPES: tuple[type, ...] = ()


def _tensor_types() -> tuple[type, ...]:
    global _TENSOR_TYPES
    if not _TENSOR_TYPES:
        import torch

        _TENSOR_TYPES = (torch.Tensor, TensorLayout)
    return _TENSOR_TYPES


def _signature(args: Sequence[Any]) -> tuple[tuple[Any, ...] | None, list[Any]]:
    """(the call's signature, its tensors): per plain torch tensor its shape, strides, dtype and
    device, per other argument its type and value. None (not cached) when an argument is a tensor
    subclass or not hashable: such calls always take the full path."""
    tensor_type = _tensor_types()[0]
    key: list[Any] = []
    tensors: list[Any] = []
    for a in args:
        if a.__class__ is tensor_type:
            key.append((a.shape, a.stride(), a.dtype, a.get_device()))
            tensors.append(a)
        elif isinstance(a, (int, float)) or a is None:  # bool is an int
            key.append((a.__class__, a))
        else:
            return None, tensors
    return tuple(key), tensors


class Function:
    """One exported kernel entry; call it like the ``tvm_ffi`` function it replaces:
    torch tensors, Python floats, ints and bools, or None.

    A call whose signature (each tensor's shape, strides, dtype and device; each other argument's
    type and value) was seen before reuses that call's laid-out buffer through a bound launcher
    (:meth:`bind`), writing only the data pointers; up to ``MAX_SIGNATURES`` signatures per
    function are kept (the backward's kernels, a forward's first calls)."""

    __slots__ = ("_bound", "_fn", "_rt", "name")
    MAX_SIGNATURES = 64

    def __init__(self, fn: Any, name: str, rt: ctypes.CDLL) -> None:
        self._fn = fn
        self.name = name
        self._rt = rt
        self._bound: dict[tuple[Any, ...], Callable[..., bool]] = {}

    def __repr__(self) -> str:
        return f"<cutefa.ffi.Function {self.name}>"

    def __call__(self, *args: Any) -> None:
        signature, tensors = _signature(args)
        launch = None if signature is None else self._bound.get(signature)
        if launch is not None and launch(*tensors):
            return
        buf, cuda_device = self._pack(args)
        self._invoke(buf, len(args), cuda_device)
        if signature is not None and launch is None and tensors and len(self._bound) < self.MAX_SIGNATURES:
            # the buffer just served a complete call: from now on it serves this signature
            slots = [i for i, a in enumerate(args) if a.__class__ is _tensor_types()[0]]
            self._bound.setdefault(signature, _bound_launcher(self, buf, len(args), cuda_device, slots))

    def _pack(self, args: Sequence[Any]) -> tuple[ctypes.Array[ctypes.c_char], int]:
        """One buffer: the TVMFFIAny array, then a DLTensor and its shape and strides per tensor,
        written by one ``struct.pack_into`` whose format is cached per argument signature."""
        if not _DTYPES:
            _DTYPES.update(_dtype_codes())
        tensor_types = _tensor_types()
        kinds = []
        for i, a in enumerate(args):
            if isinstance(a, tensor_types):
                kinds.append(a.dim())
            elif a is None:
                kinds.append("n")
            elif a is True or a is False:
                kinds.append("b")
            elif isinstance(a, int):
                kinds.append("i")
            elif isinstance(a, float):
                kinds.append("f")
            else:
                raise TypeError(f"{self.name}: argument {i}: cannot pass a {type(a).__name__}")
        key = tuple(kinds)
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = _LAYOUTS.setdefault(key, _Layout(key))
        buf = ctypes.create_string_buffer(layout.size)
        base = ctypes.addressof(buf)
        anys: list[Any] = []
        tensors: list[Any] = []
        cuda_device = -1
        for i, (a, kind, at) in enumerate(zip(args, key, layout.tensor_at)):
            if kind.__class__ is int:
                code_bits = _DTYPES.get(a.dtype)
                if code_bits is None:
                    raise TypeError(f"{self.name}: argument {i}: unsupported tensor dtype {a.dtype}")
                if a.is_cuda:
                    device_type, device = _DL_CUDA, a.get_device()
                    if cuda_device < 0:
                        cuda_device = device
                elif a.is_cpu:
                    device_type, device = _DL_CPU, 0
                else:
                    raise TypeError(f"{self.name}: argument {i}: tensors on {a.device} are not supported")
                anys += (_K_DLTENSOR_PTR, 0, base + at)
                shape_at = base + at + _DLTENSOR_SIZE
                tensors += (
                    a.data_ptr(),
                    device_type,
                    device,
                    kind,
                    *code_bits,
                    1,
                    shape_at,
                    shape_at + 8 * kind,
                    0,
                )
                tensors += a.shape
                tensors += a.stride()
            elif kind == "f":
                anys += (_K_FLOAT, 0, a)
            elif kind == "i":
                anys += (_K_INT, 0, a)
            elif kind == "b":
                anys += (_K_BOOL, 0, int(a))
            else:
                anys += (_K_NONE, 0, 0)
        layout.struct.pack_into(buf, 0, *anys, *tensors)
        return buf, cuda_device

    def _invoke(self, buf: ctypes.Array[ctypes.c_char], num_args: int, cuda_device: int) -> None:
        if _call(self._fn, self._rt, buf, num_args, _RESULT.get(), cuda_device):
            _raise_error(self._rt, self.name)

    def bind(self, args: Sequence[Any], tensor_slots: Sequence[int]) -> Callable[..., bool]:
        """A launcher for calls like ``args`` that differ only in the data pointers of the tensors at
        ``tensor_slots``: shapes, strides, dtypes, device and every other argument stay as in ``args``.

        ``launch(*tensors)`` (one tensor per slot) writes the tensors' data pointers into the
        prepared ``DLTensor`` structs and calls the kernel: the caller vouches that each tensor has
        the shape, strides, dtype and device of the bound one. It returns False, launching nothing,
        when another thread is inside the same launcher (its buffer is in use): the caller then
        takes the full call. Kernel errors raise as from a full call.
        """
        buf, cuda_device = self._pack(args)
        return _bound_launcher(self, buf, len(args), cuda_device, tensor_slots)


class TensorLayout:
    """What :meth:`Function.bind` needs of a tensor, without one: a contiguous layout of ``shape``
    and ``dtype`` on CUDA device ``device`` (data pointer 0 until a call writes one)."""

    __slots__ = ("device_index", "dtype", "shape")

    def __init__(self, shape: Sequence[int], dtype: Any, device_index: int) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.device_index = device_index

    is_cuda = True
    is_cpu = False

    def dim(self) -> int:
        return len(self.shape)

    def stride(self) -> tuple[int, ...]:
        strides, step = [], 1
        for extent in reversed(self.shape):
            strides.append(step)
            step *= max(extent, 1)
        return tuple(reversed(strides))

    def get_device(self) -> int:
        return self.device_index

    def data_ptr(self) -> int:
        return 0


class _Result(threading.local):
    """A per-thread TVMFFIAny for results (the kernels return None; the ABI wants one zeroed)."""

    def __init__(self) -> None:
        self.any = ctypes.create_string_buffer(_ANY_SIZE)

    def get(self) -> ctypes.Array[ctypes.c_char]:
        return self.any


_RESULT = _Result()


def _current_stream(device: int) -> int:
    """torch's current CUDA stream on ``device`` as an integer handle (0: the default stream).
    Replaces itself with torch's own C function on first use (one call less per launch)."""
    global _current_stream
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:

        def raw(d: int) -> int:
            return torch.cuda.current_stream(d).cuda_stream

    _current_stream = raw
    return raw(device)


def _call(
    fn: Any, rt: ctypes.CDLL, buf: ctypes.Array[ctypes.c_char], num_args: int, result: Any, device: int
) -> int:  # fmt: skip
    """The entry's return code for the arguments in ``buf``; with a CUDA ``device`` (>= 0) the call
    runs on torch's current stream of that device: it is made the TVM-FFI environment stream for
    the call when it is not already, and the previous one is put back afterwards."""
    if device < 0:
        return fn(None, buf, num_args, result)
    stream = _current_stream(device)  # a module global: replaced on first use, patchable
    if rt.TVMFFIEnvGetStream(_DL_CUDA, device) == (stream or None):
        return fn(None, buf, num_args, result)
    original = ctypes.c_void_p()
    rt.TVMFFIEnvSetStream(_DL_CUDA, device, stream, ctypes.byref(original))
    try:
        return fn(None, buf, num_args, result)
    finally:
        rt.TVMFFIEnvSetStream(_DL_CUDA, device, original, None)


def _bound_launcher(
    function: Function, buf: ctypes.Array[ctypes.c_char], num_args: int, device: int, slots: Sequence[int]
) -> Callable[..., bool]:  # fmt: skip
    """See :meth:`Function.bind`. A closure, not an object: every name the call touches is a
    local or a cell (a few hundred nanoseconds less per call than attribute look-ups)."""
    base = ctypes.addressof(buf)
    words = (ctypes.c_uint64 * (len(buf) // 8)).from_buffer(buf)
    # word index of each bound tensor's DLTensor.data (the slot's Any value points at the DLTensor)
    at = tuple((words[2 * s + 1] - base) // 8 for s in slots)
    lock = threading.Lock()
    acquire, release = lock.acquire, lock.release
    fn, rt, name = function._fn, function._rt, function.name
    result = ctypes.create_string_buffer(_ANY_SIZE)

    if len(at) == 5:
        a0, a1, a2, a3, a4 = at

        def launch(t0: Any, t1: Any, t2: Any, t3: Any, t4: Any) -> bool:
            if not acquire(False):
                return False
            try:
                words[a0] = t0.data_ptr()
                words[a1] = t1.data_ptr()
                words[a2] = t2.data_ptr()
                words[a3] = t3.data_ptr()
                words[a4] = t4.data_ptr()
                rc = _call(fn, rt, buf, num_args, result, device)
            finally:
                release()
            if rc:
                _raise_error(rt, name)
            return True

    else:

        def launch(*tensors: Any) -> bool:  # type: ignore[misc]
            if not acquire(False):
                return False
            try:
                for w, t in zip(at, tensors):
                    words[w] = t.data_ptr()
                rc = _call(fn, rt, buf, num_args, result, device)
            finally:
                release()
            if rc:
                _raise_error(rt, name)
            return True

    launch.lock = lock  # type: ignore[attr-defined]
    launch.buffer = buf  # type: ignore[attr-defined]
    return launch
