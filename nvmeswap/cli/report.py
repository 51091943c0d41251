"""``nvmeswap report``: can nvmeswap work here, and how well (``ds_report``'s async_io lines).

First the versions (nvmeswap, Python, torch, numpy, kernel, and the Cython and compiler that
built the extensions); then every check with a status, what it found and, for a problem,
the fix in one line.
"""
import errno
import os
import platform
import resource
import shutil

from .. import mounts
from ..deepspeed import deepspeed_status
from ..io.engines import URING_MEMLOCK, has_cap_ipc_lock
from ..units import human_size
from .options import check_output_path, load_torch_uninterrupted, write_json

OK, WARN, FAIL = "ok", "warn", "fail"
DEFAULT_EVENTS_PER_HANDLE = 128     # aio-nr counts each context's queue depth


def add_arguments(parser):
    parser.add_argument("--folder", action="append", dest="folders", metavar="DIR",
                        help="folder to check (repeatable; default: the current directory)")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the versions and checks to FILE as JSON "
                             "(default: printed only)")


def run(args):
    check_output_path(args.json, "--json")
    load_torch_uninterrupted()
    found = versions()
    print("versions: " + ", ".join(f"{name} {value}" for name, value in found.items()))
    print(deepspeed_status())
    checks = machine_checks() + [c for folder in (args.folders or ["."])
                                 for c in folder_checks(folder)]
    for check in checks:
        mark = {OK: "[ OK ]", WARN: "[WARN]", FAIL: "[FAIL]"}[check["status"]]
        print(f"{mark} {check['name']}: {check['found']}")
        if check.get("fix"):
            print(f"       fix: {check['fix']}")
    usable = all(c["status"] != FAIL for c in checks)
    print("nvmeswap can work here" if usable else "nvmeswap cannot work here: see [FAIL] above")
    saved = not args.json or write_json(args.json, {
        "usable": usable, "versions": found, "checks": checks,
        "deepspeed": deepspeed_status()}, "report")
    return 0 if usable and saved else 1


def versions():
    """nvmeswap, Python, torch, numpy and the kernel, and what built the extensions: the
    Cython version and compiler recorded in the compiled queues module."""
    from .. import __version__, _queues
    found = {"nvmeswap": __version__,
             "Python": platform.python_version(),
             "torch": _module_version("torch"),
             "numpy": _module_version("numpy"),
             "kernel": f"Linux {platform.release()}"}
    found.update(_build_tools(_queues.__file__))
    return found


def _module_version(name):
    try:
        module = __import__(name)
    except ImportError:
        return "not installed"
    return getattr(module, "__version__", "unknown")


def _build_tools(path):
    """Cython's ABI tag (``_cython_3_1_2``) and the compiler's ``.comment`` string
    (``GCC: (...) 12.2.0``), as the build left them in the module's bytes."""
    import re
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return {"Cython": "unknown", "compiler": "unknown"}
    cython = re.search(rb"_cython_(\d+)_(\d+)_(\d+)", data)
    compiler = re.search(rb"(GCC: \([^)]*\) [\w.]+|clang version [\w.]+)", data)
    return {"Cython": ".".join(g.decode() for g in cython.groups()) if cython else "unknown",
            "compiler": compiler.group(1).decode() if compiler else "unknown"}


def _check(name, status, found, fix=None):
    return {"name": name, "status": status, "found": found, "fix": fix}


def machine_checks():
    switches = _switches()
    return [_kernel_aio(), _aio_limit(), _memlock(), _huge_pages(), _io_uring(), _engine(),
            *switches, *([] if switches else _cuda())]


#: The on/off environment variables (nvmeswap/environment.py).
SWITCHES = ("NVMESWAP_GDS", "NVMESWAP_DEEPSPEED", "NVMESWAP_REGISTER_LOCKED",
            "DS_PIN_MEMORY_REGISTER_DEVICE")


def _switches():
    """A failed check for each switch set to what it does not take (the CUDA checks,
    which read them, are left out then)."""
    from ..environment import switch
    failed = []
    for name in SWITCHES:
        try:
            switch(name)
        except ValueError as error:
            failed.append(_check(name, FAIL, str(error), f"set {name} to 0 or 1, or unset it"))
    return failed


def _kernel_aio():
    from .._queues import AioEngine
    try:
        AioEngine(4096, 1, False, False)
    except OSError as error:
        return _check("kernel AIO", FAIL, f"io_setup failed: {os.strerror(error.errno)}",
                      "raise fs.aio-max-nr (sysctl -w fs.aio-max-nr=1048576); in a container, "
                      "allow the io_setup system call in its seccomp profile")
    return _check("kernel AIO", OK, f"io_setup works (Linux {platform.release()})")


def _aio_limit():
    try:
        limit = int(_read("/proc/sys/fs/aio-max-nr"))
        used = int(_read("/proc/sys/fs/aio-nr"))
    except OSError:
        return _check("aio-max-nr", WARN, "cannot read /proc/sys/fs/aio-max-nr")
    fit = (limit - used) // DEFAULT_EVENTS_PER_HANDLE
    found = (f"{used} of {limit} AIO events in use; room for {fit} more workers of the "
             "default queue depth (one per intra_op_parallelism per handle)")
    if fit < 64:
        return _check("aio-max-nr", WARN, found, "sysctl -w fs.aio-max-nr=1048576")
    return _check("aio-max-nr", OK, found)


def _memlock():
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if has_cap_ipc_lock():
        limit = "unlimited" if soft == resource.RLIM_INFINITY else human_size(soft)
        return _check("ulimit -l", OK, f"{limit}, and this process holds CAP_IPC_LOCK: "
                                       "locked tensors of any size")
    if soft == resource.RLIM_INFINITY:
        return _check("ulimit -l", OK, "unlimited: locked tensors of any size")
    found = (f"{human_size(soft)} and no CAP_IPC_LOCK: larger locked tensors and staging "
             "buffers work unlocked (one MemoryLockWarning), which can be slower")
    return _check("ulimit -l", WARN, found,
                  "ulimit -l unlimited (or 'memlock unlimited' in /etc/security/limits.conf; "
                  "in a container, --cap-add IPC_LOCK or --ulimit memlock=-1)")


SHMEM_HUGE_PAGES = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _huge_pages():
    """Whether locked memory (shared memory) comes in 2 MiB pages (Note [huge pages] in
    pyx/_memory.pyx)."""
    try:
        setting = _read(SHMEM_HUGE_PAGES).split("[")[1].split("]")[0]
    except (OSError, IndexError):
        setting = None
    if setting in ("advise", "always", "within_size", "force"):
        return _check("huge pages", OK, f"locked memory comes in 2 MiB pages "
                                        f"(shmem_enabled={setting})")
    found = (f"locked memory comes in 4 KiB pages (shmem_enabled={setting or 'absent'}): the "
             "kernel pins each page at every direct transfer; 2 MiB pages cut the CPU per "
             "byte 4-5x (docs/performance.md)")
    if setting is None:
        return _check("huge pages", WARN, found)
    return _check("huge pages", WARN, found,
                  f"echo advise > {SHMEM_HUGE_PAGES} (as root; it lasts until a reboot)")


def _io_uring():
    """Whether io_uring works here (pyx/_uring.pyx's probe: a ring made, an eventfd
    registered, a request completed)."""
    from ..io.engines import rings_memlock_shortage, uring_refusal
    refused = uring_refusal()
    if refused is None:
        if rings_memlock_shortage() is None:
            return _check("io_uring", OK, "works (engine='uring' or 'auto' may use it)")
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return _check("io_uring", WARN,
                      f"works, but ulimit -l is {human_size(soft)} with no CAP_IPC_LOCK: "
                      "a kernel that charges io_uring's rings to it leaves room for few (an "
                      "ordinary user held two 256-entry rings at 64 KiB), and a handle on "
                      "io_uring needs one per worker and one of its own; past the limit "
                      "engine='uring' handles fail with ENOMEM (kernel AIO does not need it; "
                      "engine='auto' chooses it)",
                      f"ulimit -l {URING_MEMLOCK >> 20}M or more (or unlimited)")
    err, why = refused
    try:
        disabled = int(_read("/proc/sys/kernel/io_uring_disabled"))
    except (OSError, ValueError):
        disabled = 0
    if disabled:
        fix = "sysctl -w kernel.io_uring_disabled=0"
    elif err in (errno.ENOSYS, errno.EPERM):
        fix = ("in a container, allow io_uring_setup, io_uring_enter and io_uring_register "
               "in its seccomp profile")
    else:
        fix = None
    return _check("io_uring", WARN, f"{why}; kernel AIO does not need it", fix)


def _engine():
    """Which engine handles run by default here, and what engine='auto' would choose."""
    from ..io.engines import ENVIRONMENT, auto_choice, checked_engine, uring_refusal
    choice, why = auto_choice()
    try:
        default = checked_engine(None)
    except ValueError as error:
        return _check("engine", FAIL, str(error), f"export {ENVIRONMENT}=aio (or uring, auto)")
    source = f"{ENVIRONMENT}={default}" if os.environ.get(ENVIRONMENT, "").strip() else \
        f"no {ENVIRONMENT}"
    runs = choice if default == "auto" else default
    found = (f"handles run on {'io_uring' if runs == 'uring' else 'kernel AIO'} by default "
             f"({source}); engine='auto' would choose {choice} ({why})")
    if default == "uring" and uring_refusal() is not None:
        return _check("engine", FAIL, found, f"export {ENVIRONMENT}=auto (or aio)")
    return _check("engine", OK, found)


def _cuda():
    checks = []
    try:
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        gpus = 0
    if gpus:
        from ..locked_tensors import register_with_cuda
        checks.append(_check("CUDA", OK, f"{gpus} GPU(s); aio_handle stages CUDA tensors "
                                         "through locked host memory"))
        checks.append(_check("locked tensors", OK, "cudaHostRegister'ed where CUDA is in use "
                             "(pinned-speed copies)" if register_with_cuda() else
                             "not registered with CUDA (NVMESWAP_REGISTER_LOCKED=0 or "
                             "DS_PIN_MEMORY_REGISTER_DEVICE=0)"))
    else:
        checks.append(_check("CUDA", OK, "no GPU: host tensors only (nothing needed)"))
    from ..gpu.discovery import gds_available, gds_unavailable_reason, hidden_by, nvidia_fs_loaded
    cufile = gds_available()
    if cufile:
        mode = "GDS proper (nvidia-fs loaded)" if nvidia_fs_loaded() else \
            "compat mode (no nvidia-fs)"
        checks.append(_check("cuFile", OK, f"cuFile loads; GDS would run in {mode}"))
    elif hidden_by() is not None:
        checks.append(_check("cuFile", OK, f"hidden: {gds_unavailable_reason()}",
                             f"unset {hidden_by().split('=')[0]} to let gds_handle use it"))
    else:
        checks.append(_check("cuFile", OK, f"no GPUDirect Storage: {gds_unavailable_reason()}",
                             "pip install nvidia-cufile-cu12 (or the CUDA toolkit's GDS) to "
                             "add it; host tensors do not need it"))
    return checks


def folder_checks(folder):
    name = f"folder {folder}"
    if os.path.exists(folder) and not os.path.isdir(folder):
        return [_check(name, FAIL, "is not a folder", "give a folder on the SSD")]
    if not os.path.isdir(folder):
        return [_check(name, FAIL, "does not exist", f"mkdir -p {folder}")]
    if not os.access(folder, os.W_OK | os.X_OK):
        return [_check(name, FAIL, "not writable", f"chmod u+w {folder}, or pick another folder")]
    mount = mounts.of_folder(folder)
    fs_type, device = (mount.fs_type, mount.source) if mount else ("unknown", "unknown")
    free = shutil.disk_usage(folder).free
    checks = [_check(name, OK, f"{fs_type} on {device}, {human_size(free)} free")]
    checks.append(_o_direct(folder))
    from ..gpu.discovery import gds_available
    if not _switches() and gds_available():
        checks.append(cufile_takes_files(folder))
    return checks


def cufile_takes_files(folder):
    """Whether cuFile registers a file here (Note [cuFile refusing a file]): a cloud VM
    without nvidia-fs loads cuFile and opens its driver, then refuses every file."""
    from .. import _cufile
    from ..errors import CuFileError
    from ..io.cufile_placement import FILE_REFUSALS
    name = f"cuFile in {folder}"
    path = os.path.join(folder, f".nvmeswap-report-cufile-{os.getpid()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as error:
        return _check(name, WARN, f"cannot open a file with O_DIRECT: {os.strerror(error.errno)}")
    try:
        _cufile.driver_open()
        try:
            _cufile.handle_deregister(_cufile.handle_register(fd))
        finally:
            _cufile.driver_close()
    except CuFileError as error:
        if error.code in FILE_REFUSALS:
            return _check(name, WARN, f"refuses files here ({error.name}): gds_handle moves "
                                      "CUDA tensors through locked host memory for them")
        return _check(name, WARN, f"cannot be used ({error.name})")
    finally:
        os.close(fd)
        os.unlink(path)
    return _check(name, OK, "registers files here: gds_handle moves CUDA tensors with cuFile")


def _o_direct(folder):
    name = f"O_DIRECT in {folder}"
    path = os.path.join(folder, f".nvmeswap-report-{os.getpid()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return _check(name, WARN, "refused by the filesystem: I/O goes through the page "
                                      "cache (slower, uses memory)",
                          "put the files on ext4, XFS or another filesystem with O_DIRECT")
        return _check(name, FAIL, f"cannot create a file: {os.strerror(error.errno)}")
    try:
        from ..io.regions import SharedRegion
        region = SharedRegion(4096)
        try:
            os.pwrite(fd, region.mapping, 0)
        finally:
            region.close()
    except OSError as error:
        return _check(name, WARN, f"open works but a 4 KiB direct write failed "
                                  f"({os.strerror(error.errno)})")
    finally:
        os.close(fd)
        os.unlink(path)
    return _check(name, OK, "accepted")


def _read(path):
    with open(path) as f:
        return f.read()
