"""OOM classification (dptune.step.oom) from real exception types and torch's message shapes."""

from __future__ import annotations

import traceback

import pytest
import torch

from dptune.step.oom import is_oom, oom_device, oom_summary, original_message, replica_where

NEW_MSG = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
           "79.19 GiB of which 1.25 GiB is free. Including non-PyTorch memory, this process has "
           "77.93 GiB memory in use. Of the allocated memory 76.50 GiB is allocated by PyTorch, "
           "and 912.00 MiB is reserved by PyTorch but unallocated.")
OLD_MSG = ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 10.76 GiB total capacity; "
           "9.80 GiB already allocated; 5.56 MiB free; 9.90 GiB reserved in total by PyTorch)")


def _raise_in_user_code(exc: BaseException) -> None:
    raise exc  # a "user" frame, as a replica's forward would be


def replica_reraise(exc: BaseException, replica: int, device: int) -> BaseException:
    """What DataParallel's parallel_apply raises in the caller for ``exc`` in a replica thread.

    ``torch._utils.ExceptionWrapper`` (private) formats the traceback in the thread and
    ``reraise`` builds ``exc_type(f"Caught {name} {where}.\\nOriginal {traceback}")``.
    """
    try:
        _raise_in_user_code(exc)
    except BaseException as caught:  # noqa: BLE001
        text = "".join(traceback.format_exception(type(caught), caught, caught.__traceback__))
    where = f"in replica {replica} on device {device}"
    return type(exc)(f"Caught {type(exc).__name__} {where}.\nOriginal {text}")


def test_replica_helper_matches_torch_exception_wrapper():
    # The private class exists in this torch; check that our helper writes what it writes.
    from torch._utils import ExceptionWrapper

    try:
        _raise_in_user_code(torch.OutOfMemoryError(NEW_MSG))
    except torch.OutOfMemoryError:
        wrapper = ExceptionWrapper(where="in replica 1 on device 1")
    with pytest.raises(torch.OutOfMemoryError) as info:
        wrapper.reraise()
    mine = replica_reraise(torch.OutOfMemoryError(NEW_MSG), 1, 1)
    assert str(info.value).split("\n")[0] == str(mine).split("\n")[0]
    assert str(info.value).rstrip().endswith(NEW_MSG)
    assert oom_device(info.value) == 1 and is_oom(info.value)


def test_torch_out_of_memory_error_by_type():
    exc = torch.OutOfMemoryError(NEW_MSG)
    assert is_oom(exc)
    assert oom_device(exc) == 1
    assert isinstance(exc, RuntimeError)


def test_torch_cuda_alias_is_the_same_type():
    assert is_oom(torch.cuda.OutOfMemoryError("whatever"))


def test_old_message_format_names_the_gpu():
    exc = torch.OutOfMemoryError(OLD_MSG)
    assert oom_device(exc) == 0
    # a plain RuntimeError with the text (older torch) is found by message
    assert is_oom(RuntimeError(OLD_MSG))
    assert oom_device(RuntimeError(OLD_MSG)) == 0


def test_replica_thread_reraise():
    exc = replica_reraise(torch.OutOfMemoryError(NEW_MSG.replace("GPU 1", "GPU 3")), 2, 3)
    assert isinstance(exc, torch.OutOfMemoryError)
    assert str(exc).startswith("Caught OutOfMemoryError in replica 2 on device 3.\nOriginal Traceback")
    assert is_oom(exc)
    assert oom_device(exc) == 3
    assert replica_where(exc) == (2, 3)
    assert original_message(exc).startswith("CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert oom_summary(exc).startswith("CUDA out of memory")


def test_replica_device_used_when_message_names_no_gpu():
    exc = replica_reraise(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                       "`cublasCreate(handle)`"), 1, 2)
    assert type(exc) is RuntimeError
    assert is_oom(exc)
    assert oom_device(exc) == 2


@pytest.mark.parametrize("msg", [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
])
def test_ooms_in_disguise(msg):
    exc = RuntimeError(msg)
    assert is_oom(exc)
    assert oom_device(exc) is None


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
    RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasSgemm( handle)`"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    ValueError("CUDA out of memory"),          # not an error type torch raises for OOM
    KeyError("out of memory"),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes"),
])
def test_not_oom(exc):
    assert not is_oom(exc)


def test_traceback_source_lines_are_not_matched():
    # A replica's user error whose quoted source line mentions OOM is not an OOM.
    def user_forward():
        raise RuntimeError("shape mismatch")  # CUDA out of memory would look different

    try:
        user_forward()
    except RuntimeError as caught:
        text = "".join(traceback.format_exception(type(caught), caught, caught.__traceback__))
    exc = RuntimeError(f"Caught RuntimeError in replica 1 on device 1.\nOriginal {text}")
    assert "CUDA out of memory" in str(exc)
    assert original_message(exc) == "shape mismatch"
    assert not is_oom(exc)


def test_chained_oom_counts():
    try:
        try:
            raise torch.OutOfMemoryError(NEW_MSG)
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("my training wrapper failed") from inner
    except RuntimeError as outer:
        assert is_oom(outer)


def test_device_from_cuda_colon_and_none():
    assert oom_device(RuntimeError("CUDA error: out of memory on cuda:2")) == 2
    assert oom_device("CUDA error: out of memory") is None
    assert oom_device("") is None


def test_summary_is_one_line_and_bounded():
    s = oom_summary(NEW_MSG * 5, limit=80)
    assert "\n" not in s and len(s) <= 80 and s.endswith("...")
