"""cutefa.ffi: the ctypes caller of the TVM-FFI C ABI, against a stand-in kernel entry.

The stand-in is a ctypes callback with the kernels' signature (``int fn(void*, const TVMFFIAny*,
int32_t, TVMFFIAny*)``): it decodes what it was given (type indices, DLTensor fields, shapes,
strides, scalars) and the environment stream during the call, or raises an error through
libtvm_ffi like a kernel that refuses its arguments. Real kernels are called this way in
tests/test_pack_build.py and tests/test_compile_cache.py (CPU) and on the GPU.
"""

from __future__ import annotations

import ctypes
import struct
import subprocess
import sys

import pytest
import torch
from pack_support import build_so

from cutefa import ffi

SAFE_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p)


def decode(args: int, num_args: int) -> list:
    """The arguments as the kernel sees them: ('tensor', fields...) or (type index, value)."""
    out = []
    for i in range(num_args):
        type_index, _, raw = struct.unpack("<iIQ", ctypes.string_at(args + 16 * i, 16))
        if type_index == 7:
            data, dev_type, dev_id, ndim, code, bits, lanes, shape, strides, offset = struct.unpack(
                "<QiiiBBHQQQ", ctypes.string_at(raw, 48)
            )
            dims = struct.unpack(f"<{ndim}q", ctypes.string_at(shape, 8 * ndim)) if ndim else ()
            steps = struct.unpack(f"<{ndim}q", ctypes.string_at(strides, 8 * ndim)) if ndim else ()
            out.append(("tensor", data, dev_type, dev_id, (code, bits, lanes), dims, steps, offset))
        elif type_index == 3:
            out.append((3, struct.unpack("<d", struct.pack("<Q", raw))[0]))
        else:
            out.append((type_index, struct.unpack("<q", struct.pack("<Q", raw))[0]))
    return out


class StandIn:
    """A kernel entry that records its calls (and the CUDA env stream of device 0 during each)."""

    def __init__(self, error: tuple[str, str] | None = None) -> None:
        self.calls: list[list] = []
        self.streams: list[int | None] = []
        self.error = error
        rt = ffi.runtime()
        rt.TVMFFIErrorSetRaisedFromCStr.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        rt.TVMFFIErrorSetRaisedFromCStr.restype = None

        def entry(handle, args, num_args, result):
            self.calls.append(decode(args, num_args))
            self.streams.append(rt.TVMFFIEnvGetStream(2, 0))
            if self.error is not None:
                rt.TVMFFIErrorSetRaisedFromCStr(self.error[0].encode(), self.error[1].encode())
                return -1
            return 0

        self.c_entry = SAFE_CALL(entry)
        self.function = ffi.Function(self.c_entry, "stand_in", rt)


def test_full_call_lays_out_tensors_and_scalars():
    stand_in = StandIn()
    q = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16)
    v = torch.randn(2, 7, 3, 8, dtype=torch.float16).transpose(1, 2)  # strided view
    lse = torch.empty(2, 3, 5)
    stand_in.function(q, v, lse, 0.125, 7, True, None)
    (call,) = stand_in.calls
    assert call[0] == ("tensor", q.data_ptr(), 1, 0, (4, 16, 1), (2, 5, 3, 8), q.stride(), 0)
    assert call[1] == ("tensor", v.data_ptr(), 1, 0, (2, 16, 1), tuple(v.shape), v.stride(), 0)
    assert call[2] == ("tensor", lse.data_ptr(), 1, 0, (2, 32, 1), (2, 3, 5), (15, 5, 1), 0)
    assert call[3:] == [(3, 0.125), (1, 7), (2, 1), (0, 0)]
    assert stand_in.streams == [None]  # CPU tensors: the env stream is left alone


def test_fp8_and_zero_dim_tensors():
    stand_in = StandIn()
    x = torch.zeros(4, 16, dtype=torch.float8_e4m3fn)
    scalar = torch.tensor(2.0)
    stand_in.function(x, scalar)
    (call,) = stand_in.calls
    assert call[0][4] == (10, 8, 1) and call[0][5] == (4, 16)
    assert call[1][4] == (2, 32, 1) and call[1][5] == () and call[1][6] == ()


def test_unsupported_arguments_are_refused_before_the_call():
    stand_in = StandIn()
    with pytest.raises(TypeError, match="argument 1: cannot pass a str"):
        stand_in.function(1.0, "x")
    with pytest.raises(TypeError, match="unsupported tensor dtype"):
        stand_in.function(torch.zeros(2, dtype=torch.complex64))
    assert stand_in.calls == []


@pytest.mark.parametrize(
    ("kind", "expected"), [("ValueError", ValueError), ("TypeError", TypeError), ("CudaError", RuntimeError)]
)
def test_errors_raised_by_the_kernel_become_python_exceptions(kind, expected):
    stand_in = StandIn(error=(kind, "Mismatched Tensor on argument #0"))
    with pytest.raises(expected, match="Mismatched Tensor on argument #0") as info:
        stand_in.function(torch.zeros(3))
    if expected is RuntimeError:
        assert str(info.value).startswith("CudaError: ")
    # the error was moved out of libtvm_ffi: the next call starts clean
    stand_in.error = None
    stand_in.function(torch.zeros(3))


def test_bound_launch_writes_only_the_data_pointers(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(ffi, "_current_stream", lambda device: 0x5000 + device)
    layouts = [
        ffi.TensorLayout((2, 5, 3, 8), torch.bfloat16, 0),
        ffi.TensorLayout((2, 3, 5), torch.float32, 0),
    ]
    bound = stand_in.function.bind([*layouts, 0.5, 132], (0, 1))
    assert stand_in.calls == []  # binding calls nothing
    a, b = torch.empty(2, 5, 3, 8, dtype=torch.bfloat16), torch.empty(2, 3, 5)
    c, d = torch.empty_like(a), torch.empty_like(b)
    assert bound(a, b) and bound(c, d)
    first, second = stand_in.calls
    assert first[0] == ("tensor", a.data_ptr(), 2, 0, (4, 16, 1), (2, 5, 3, 8), (120, 24, 8, 1), 0)
    assert first[1] == ("tensor", b.data_ptr(), 2, 0, (2, 32, 1), (2, 3, 5), (15, 5, 1), 0)
    assert first[2:] == [(3, 0.5), (1, 132)]
    assert [second[0][1], second[1][1]] == [c.data_ptr(), d.data_ptr()] and second[2:] == first[2:]
    # torch's stream for the call, the previous env stream restored after it
    assert stand_in.streams == [0x5000, 0x5000]
    assert ffi.runtime().TVMFFIEnvGetStream(2, 0) is None


def test_bound_launch_is_refused_while_another_thread_holds_it(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(ffi, "_current_stream", lambda device: 0)
    bound = stand_in.function.bind([ffi.TensorLayout((4,), torch.float32, 0)], (0,))
    bound.lock.acquire()
    try:
        assert bound(torch.empty(4)) is False  # the caller takes the full path instead
    finally:
        bound.lock.release()
    assert bound(torch.empty(4)) is True and len(stand_in.calls) == 1


def test_bound_errors_raise_and_release_the_launcher(monkeypatch):
    stand_in = StandIn(error=("ValueError", "Misaligned Tensor data on argument #0"))
    monkeypatch.setattr(ffi, "_current_stream", lambda device: 0)
    bound = stand_in.function.bind([ffi.TensorLayout((4,), torch.float32, 0)], (0,))
    with pytest.raises(ValueError, match="Misaligned"):
        bound(torch.empty(4))
    stand_in.error = None
    assert bound(torch.empty(4)) is True


def test_tensor_layout_strides_are_contiguous():
    layout = ffi.TensorLayout((2, 0, 3, 4), torch.float16, 1)
    assert layout.stride() == torch.empty(2, 0, 3, 4).stride() and layout.dim() == 4
    assert layout.get_device() == 1 and layout.data_ptr() == 0


def test_loading_needs_no_tvm_ffi_package():
    code = (
        "import sys, cutefa.ffi as f; f.runtime(); "
        "print('tvm_ffi' in sys.modules, f.tvm_ffi_library_path().name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "libtvm_ffi.so"]


def test_a_library_without_the_function_is_refused(tmp_path):
    path = build_so(tmp_path / "k.so", "something")  # a real shared object that exports another entry
    with pytest.raises(ffi.KernelLoadError, match=f"{path} exports no TVM-FFI function 'nothing'"):
        ffi.load(path, "nothing")
    assert ffi.load(path, "something")() is None


def test_a_file_that_is_no_library_is_a_load_error(tmp_path):
    path = tmp_path / "k.so"
    path.write_bytes(b"\x7fELF but not really")
    with pytest.raises(ffi.KernelLoadError, match=str(path)):  # the file's name, not /proc/self/fd/N
        ffi.load(path, "k")


def test_full_calls_of_a_seen_signature_reuse_its_buffer(monkeypatch):
    stand_in = StandIn()
    packs = []
    real_pack = ffi.Function._pack
    monkeypatch.setattr(
        ffi.Function, "_pack", lambda self, args: packs.append(len(args)) or real_pack(self, args)
    )
    a, b = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8)
    lse = torch.empty(2, 3, 5)
    stand_in.function(a, lse, 0.5, 7)
    stand_in.function(b, lse, 0.5, 7)  # same signature: the bound buffer, new data pointers
    assert packs == [6 - 2] and len(stand_in.calls) == 2
    assert stand_in.calls[1][0] == ("tensor", b.data_ptr(), 1, 0, (2, 32, 1), (2, 5, 3, 8), b.stride(), 0)
    assert stand_in.calls[1][1:] == stand_in.calls[0][1:]
    # another signature each: other strides, another scalar value or type, a tensor subclass
    stand_in.function(a.transpose(1, 2), lse, 0.5, 7)
    stand_in.function(a, lse, 0.25, 7)
    stand_in.function(a, lse, 0.5, 7.0)
    stand_in.function(a, lse, 0.5, True)
    assert len(packs) == 5
    assert stand_in.calls[-1][3] == (2, 1) and stand_in.calls[-2][3] == (3, 7.0)
    param = torch.nn.Parameter(torch.randn(4))
    stand_in.function(param)
    stand_in.function(param)
    assert len(packs) == 7  # tensor subclasses always take the full path
    assert all(call[0][1] == param.data_ptr() for call in stand_in.calls[-2:])


def test_a_refused_call_is_not_remembered(monkeypatch):
    stand_in = StandIn(error=("ValueError", "Misaligned Tensor data on argument #0"))
    x = torch.randn(4)
    with pytest.raises(ValueError):
        stand_in.function(x)
    assert stand_in.function._bound == {}
    stand_in.error = None
    stand_in.function(x)
    assert len(stand_in.function._bound) == 1
