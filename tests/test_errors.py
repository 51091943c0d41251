"""Bad input and failed I/O: the exact exception, errno and file name; nothing lost."""
import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import needs_torch, random_bytes, without_file_privileges

import nvmeswap
from nvmeswap.errors import short_file_error


def test_missing_file(handle, tmp_path):
    path = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError) as info:
        handle.sync_pread(bytearray(10), path)
    assert info.value.errno == errno.ENOENT and info.value.filename == path
    with pytest.raises(FileNotFoundError) as info:
        handle.async_pread(bytearray(10), path)
    assert info.value.filename == path
    assert handle.wait() == 0


def test_missing_folder_on_write(handle, tmp_path):
    path = str(tmp_path / "no" / "such" / "dir")
    with pytest.raises(FileNotFoundError) as info:
        handle.sync_pwrite(bytearray(10), path)
    assert info.value.filename == path


def test_directory(handle, tmp_path):
    with pytest.raises(IsADirectoryError) as info:
        handle.sync_pread(bytearray(10), str(tmp_path))
    assert info.value.errno == errno.EISDIR and info.value.filename == str(tmp_path)
    with pytest.raises(IsADirectoryError) as info:
        handle.sync_pwrite(bytearray(10), str(tmp_path))
    assert info.value.filename == str(tmp_path)


def test_file_too_short(handle, tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"a" * 5000)
    target = bytearray(b"\x55" * 6000)
    with pytest.raises(nvmeswap.ShortFileError) as info:
        handle.sync_pread(target, path)
    message = str(info.value)
    assert info.value.filename == str(path)
    assert "6000 bytes at offset 0" in message and "5000 bytes long" in message
    assert target == b"\x55" * 6000      # nothing claimed as read
    with pytest.raises(nvmeswap.ShortFileError, match="at offset 4096"):
        handle.sync_pread(bytearray(1000), path, 4096)


def test_read_only_buffer_as_read_target(handle, tmp_path):
    (tmp_path / "f").write_bytes(b"z" * 100)
    with pytest.raises(TypeError, match="read-only"):
        handle.sync_pread(b"x" * 100, tmp_path / "f")
    readonly = np.zeros(100, dtype=np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        handle.sync_pread(readonly, tmp_path / "f")


def test_non_contiguous_buffers(handle, tmp_path):
    with pytest.raises(ValueError, match="not C-contiguous"):
        handle.sync_pwrite(np.zeros((10, 10))[:, 1], tmp_path / "f")
    assert not (tmp_path / "f").exists()     # nothing written for a rejected write


@needs_torch
def test_non_contiguous_tensors(handle, tmp_path):
    import torch

    with pytest.raises(ValueError, match="not contiguous"):
        handle.sync_pwrite(torch.zeros(10, 10).t(), tmp_path / "f")
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1.5, TypeError), ("0", TypeError),
                                     (True, TypeError)])
def test_bad_offsets(handle, tmp_path, bad, exc):
    with pytest.raises(exc, match="file_offset"):
        handle.sync_pwrite(bytearray(10), tmp_path / "f", bad)
    assert not (tmp_path / "f").exists()


def test_wrong_types_and_empty_buffers(handle, tmp_path):
    with pytest.raises(TypeError, match="got list"):
        handle.sync_pwrite([1, 2, 3], tmp_path / "f")
    with pytest.raises(TypeError, match="file name or an int file descriptor"):
        handle.sync_pwrite(bytearray(10), 3.5)
    with pytest.raises(ValueError, match="empty"):
        handle.sync_pwrite(bytearray(), tmp_path / "f")
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("kwargs,exc", [
    ({"block_size": 0}, ValueError), ({"block_size": -4096}, ValueError),
    ({"block_size": (1 << 30) + 1}, ValueError), ({"queue_depth": 0}, ValueError),
    ({"queue_depth": 1 << 20}, ValueError), ({"intra_op_parallelism": 0}, ValueError),
    ({"intra_op_parallelism": 10_000}, ValueError), ({"block_size": "1M"}, TypeError),
    ({"single_submit": "yes"}, TypeError), ({"o_direct": "auto"}, TypeError),
])
def test_bad_constructor_arguments(kwargs, exc):
    with pytest.raises(exc):
        nvmeswap.aio_handle(**kwargs)


def test_use_after_close(tmp_path):
    h = nvmeswap.aio_handle()
    h.close()
    h.close()     # idempotent
    for call in (lambda: h.sync_pwrite(bytearray(1), tmp_path / "f"),
                 lambda: h.async_pread(bytearray(1), tmp_path / "f"), h.wait,
                 # closed is said before the example is looked at (or torch imported)
                 lambda: h.new_cpu_locked_tensor(1)):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_fd_open_read_only_cannot_be_written(handle, tmp_path):
    path = tmp_path / "ro"
    path.write_bytes(b"q" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            handle.async_pwrite(bytearray(10), fd)
        assert info.value.errno == errno.EBADF and info.value.filename == str(path)
    finally:
        os.close(fd)


def test_running_out_of_descriptors_names_the_file_given_by_descriptor(handle, tmp_path,
                                                                       monkeypatch):
    """An unaligned read of a caller's fd opens the file a second time (buffered); out of
    descriptors there, the error names the file, not the /proc path it was opened by."""
    from nvmeswap.io import files
    path = tmp_path / "f"
    path.write_bytes(random_bytes(8192))
    real_open = files.os.open

    def second_open_refused(name, flags, *args):
        if not flags & os.O_DIRECT:
            raise OSError(errno.EMFILE, "Too many open files", name)
        return real_open(name, flags, *args)
    monkeypatch.setattr(files.os, "open", second_open_refused)
    fd = real_open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            handle.sync_pread(bytearray(100), fd, 10)
        assert info.value.errno == errno.EMFILE and info.value.filename == str(path)
    finally:
        os.close(fd)


def test_buffered_fallback_when_o_direct_is_refused(handle_factory, tmp_path, monkeypatch):
    """Simulates a filesystem that refuses O_DIRECT (tmpfs did before Linux 6.6)."""
    from nvmeswap import errors
    from nvmeswap.io import files
    real_open = os.open

    def refusing_open(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(files.os, "open", refusing_open)
    monkeypatch.setattr(errors, "_warned", set())
    h = handle_factory()
    data = random_bytes(100_003)
    with pytest.warns(nvmeswap.BufferedIOWarning, match="refuses O_DIRECT"):
        h.sync_pwrite(bytearray(data), tmp_path / "b", 7)
    back = bytearray(len(data))
    h.sync_pread(back, tmp_path / "b", 7)
    assert back == data
    strict = handle_factory(o_direct=True)
    with pytest.raises(OSError) as info:
        strict.sync_pread(back, tmp_path / "b", 7)
    assert info.value.errno == errno.EINVAL


PERMISSION_SCRIPT = textwrap.dedent("""
    import errno, sys
    sys.path.insert(0, sys.argv[2])
    import nvmeswap
    with nvmeswap.aio_handle() as h:
        for call in (h.sync_pread, h.sync_pwrite):
            try:
                call(bytearray(10), sys.argv[1])
            except PermissionError as e:
                assert e.errno == errno.EACCES and e.filename == sys.argv[1], e
            else:
                raise SystemExit("no PermissionError")
    print("ok")
""")


def test_no_permission(tmp_path):
    """A file whose mode grants its owner nothing: reading and writing it are EACCES."""
    path = tmp_path / "secret"
    path.write_bytes(b"s" * 100)
    path.chmod(0o000)
    package_root = os.path.dirname(os.path.dirname(nvmeswap.__file__))
    command = [*without_file_privileges(), sys.executable, "-c", PERMISSION_SCRIPT, str(path),
               package_root]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_fork_child_cannot_use_the_handle(handle, tmp_path):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            handle.sync_pwrite(bytearray(10), tmp_path / "child")
        except RuntimeError as error:
            code = 0 if "after fork()" in str(error) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (tmp_path / "child").exists()
    handle.sync_pwrite(bytearray(b"p" * 10), tmp_path / "parent")   # the parent's is fine
    assert (tmp_path / "parent").read_bytes() == b"p" * 10


def test_every_error_crosses_a_process_boundary_as_it_was_raised():
    """A pool's worker sends its exception back pickled: each of the package's errors
    comes back the same type, message and fields (else the pool's result thread dies on
    it, and ``get()`` waits for ever)."""
    import pickle

    errors = [nvmeswap.ValidationError("bytes differ at offset 8", "/f", 8),
              nvmeswap.CuFileError(5011, "cuFileRead", 700),
              nvmeswap.CudaError(2, "cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY"),
              short_file_error("/f", "short read: got 0 of 10 bytes"),
              nvmeswap.WorkerDied("worker 1 died"),
              nvmeswap.MemoryBudgetError("over the budget")]
    for error in errors:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert vars(back) == vars(error) and back.args == error.args
