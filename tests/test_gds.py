"""cuFile's loader and error mapping, against a fake libcufile built by the test.

No GPU is needed: the fake library answers like cuFile (success, cuFile error codes,
system errors), which is all the CPU side sees. Real GPU round trips are not tested here.
"""
import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from fake_gpu import FAKE_CUDA, build

import nvmeswap
from nvmeswap import _cufile

FAKE_CUFILE = textwrap.dedent("""
    #include <errno.h>
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    #include <sys/types.h>
    typedef struct { int err; int cu_err; } status;
    typedef struct { int type; union { int fd; void *handle; } handle; const void *ops; } descr;
    static status ok(void) { status s = {0, 0}; return s; }
    status cuFileDriverOpen(void) {
        status s = {getenv("FAKE_CUFILE_NO_DRIVER") ? 5001 : 0, 0};
        return s;
    }
    status cuFileDriverClose(void) { return ok(); }
    status cuFileHandleRegister(void **handle, descr *d) {
        *handle = (void *)(intptr_t)(d->handle.fd + 1000);
        return ok();
    }
    void cuFileHandleDeregister(void *handle) { (void)handle; }
    status cuFileBufRegister(const void *p, size_t n, int flags) {
        status s = {5011, 700};  /* CU_FILE_CUDA_DRIVER_ERROR, CUDA_ERROR_ILLEGAL_ADDRESS */
        (void)p; (void)n; (void)flags;
        return s;
    }
    status cuFileBufDeregister(const void *p) { (void)p; return ok(); }
    ssize_t cuFileRead(void *h, void *base, size_t n, off_t off, off_t base_off) {
        (void)h; (void)off;
        if (n == 7) return -5024;                  /* CU_FILE_MEMORY_NOT_REGISTERED */
        if (n == 9) { errno = EIO; return -1; }
        memset((char *)base + base_off, 0xAB, n);
        return (ssize_t)n;
    }
    #ifndef WITHOUT_WRITE
    ssize_t cuFileWrite(void *h, const void *base, size_t n, off_t off, off_t base_off) {
        (void)h; (void)base; (void)off; (void)base_off;
        return (ssize_t)n;
    }
    #endif
""")


def _build(tmp_path, name, *defines):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the fake cuFile library")
    source = tmp_path / "fake_cufile.c"
    source.write_text(FAKE_CUFILE)
    library = tmp_path / name
    subprocess.run([compiler, "-shared", "-fPIC", *defines, "-o", str(library), str(source)],
                   check=True)
    return library


@pytest.fixture
def fake_cufile(tmp_path):
    ok, why = _cufile.load(_build(tmp_path, "libcufile.so.0"))
    assert ok, why
    return tmp_path


def test_calls_and_their_errors(fake_cufile, monkeypatch):
    _cufile.driver_open()
    monkeypatch.setenv("FAKE_CUFILE_NO_DRIVER", "1")
    with pytest.raises(nvmeswap.CuFileError) as info:
        _cufile.driver_open()
    assert info.value.code == 5001 and info.value.name == "CU_FILE_DRIVER_NOT_INITIALIZED"
    assert str(info.value) == "cuFileDriverOpen failed: CU_FILE_DRIVER_NOT_INITIALIZED"

    handle = _cufile.handle_register(5)
    assert handle == 1005
    buffer = bytearray(64)
    from nvmeswap._memory import buffer_address
    address = buffer_address(buffer, True)[0]
    assert _cufile.read(handle, address, 16, 0, 8) == 16
    assert buffer[8:24] == b"\xab" * 16 and buffer[:8] == bytes(8)
    with pytest.raises(nvmeswap.CuFileError, match="cuFileRead failed: "
                                                   "CU_FILE_MEMORY_NOT_REGISTERED"):
        _cufile.read(handle, address, 7, 0, 0)
    with pytest.raises(OSError) as info:
        _cufile.read(handle, address, 9, 0, 0)
    assert info.value.errno == errno.EIO
    assert _cufile.write(handle, address, 32, 4096, 0) == 32
    with pytest.raises(nvmeswap.CuFileError, match=r"CU_FILE_CUDA_DRIVER_ERROR \(CUDA error 700\)"):
        _cufile.buf_register(address, 64)
    _cufile.handle_deregister(handle)


def test_a_library_without_every_function_is_refused(tmp_path):
    ok, why = _cufile.load(_build(tmp_path, "libpartial.so", "-DWITHOUT_WRITE"))
    assert not ok and "has no cuFileWrite" in why
    assert not _cufile.loaded()
    with pytest.raises(RuntimeError, match="not loaded"):
        _cufile.driver_open()


def test_gds_available_finds_the_libraries_named_by_the_environment(tmp_path):
    library = _build(tmp_path, "libcufile.so.0")
    driver = build(tmp_path, "libcuda.so.1", FAKE_CUDA)
    code = "import nvmeswap; print(nvmeswap.gds_available(), nvmeswap.gds_unavailable_reason())"

    def answer(**paths):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, **paths}, check=False).stdout.strip()

    assert answer(NVMESWAP_CUFILE_LIBRARY=str(library), NVMESWAP_CUDA_LIBRARY=str(driver)) \
        == "True"
    try:
        import ctypes
        ctypes.CDLL("libcufile.so.0")
        ctypes.CDLL("libcuda.so.1")
        return      # a real cuFile and driver are installed: they would be found instead
    except OSError:
        pass
    missing = answer(NVMESWAP_CUFILE_LIBRARY=str(tmp_path / "nope.so"))
    assert missing.startswith("False cuFile could not be loaded") and "nope.so" in missing
    no_driver = answer(NVMESWAP_CUFILE_LIBRARY=str(library),
                       NVMESWAP_CUDA_LIBRARY=str(tmp_path / "nodriver.so"))
    assert no_driver.startswith("False the CUDA driver could not be loaded") and \
        "nodriver.so" in no_driver


def test_a_driver_library_without_every_function_is_refused(tmp_path):
    partial = build(tmp_path, "libpartial_cuda.so", FAKE_CUDA.replace("cuIpcCloseMemHandle",
                                                                       "renamed"))
    code = (f"from nvmeswap import _cuda; print(_cuda.load({str(partial)!r}), _cuda.loaded())")
    answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert "has no cuIpcCloseMemHandle" in answer.stdout and answer.stdout.strip().endswith(
        "False"), answer


def test_worker_error_codes_become_named_exceptions():
    from nvmeswap.errors import CUDA_ERROR, CUFILE_ERROR, error_code, error_from_code

    cufile = error_from_code(CUFILE_ERROR + 5024, "/f", "read of 4096 bytes at offset 0")
    assert isinstance(cufile, nvmeswap.CuFileError) and cufile.filename == "/f"
    assert cufile.name == "CU_FILE_MEMORY_NOT_REGISTERED"
    assert str(cufile) == ("/f: cuFile read of 4096 bytes at offset 0 failed: "
                           "CU_FILE_MEMORY_NOT_REGISTERED")
    cuda = error_from_code(CUDA_ERROR + 400, "/f", "write of 1 bytes at offset 0")
    assert isinstance(cuda, nvmeswap.CudaError) and cuda.code == 400 and cuda.filename == "/f"
    assert str(cuda) == f"/f: CUDA IPC for the write of 1 bytes at offset 0 failed: {cuda.name}"
    plain = error_from_code(errno.ENOSPC, "/f", "write")
    assert type(plain) is OSError and plain.errno == errno.ENOSPC and plain.filename == "/f"
    missing = error_from_code(errno.ENOENT, "/f", "read")
    assert type(missing) is FileNotFoundError and missing.errno == errno.ENOENT
    assert missing.filename == "/f" and missing.strerror == f"{os.strerror(errno.ENOENT)} (read)"
    # A worker's code comes back to the same code: the two directions agree.
    for code in (CUFILE_ERROR + 5024, CUDA_ERROR + 400, errno.ENOSPC, errno.ENOENT):
        assert error_code(error_from_code(code, "/f", "read")) == code
    assert error_code(ValueError("not an OSError")) == errno.EIO
