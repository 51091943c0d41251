"""Fake libcuda and libcufile, built by the tests, for gds_handle's road without a GPU.

"Device memory" is host memory in a memfd mapping whose descriptor its maker keeps
open (stand_in_device.device_tensor(shared=True)): the fake driver exports an
allocation as (pid, that descriptor, the mapping's range and file offset), and a
worker maps it again through /proc/<pid>/fd/<fd>, which any process of the same user
may open (/proc/<pid>/map_files would need CAP_SYS_ADMIN).
The fake cuFile reads and writes with pread/pwrite through an aligned bounce buffer
(as cuFile's compat mode does), so the file side keeps O_DIRECT's rules; it keeps a
table of registered buffers, and reads its configuration file the way cuFile does
($CUFILE_ENV_PATH_JSON): a configuration containing "fail_driver_open" makes
cuFileDriverOpen fail with CU_FILE_DRIVER_INVALID_PROPS.
"""
import shutil
import subprocess
import textwrap

import pytest

FAKE_CUDA = textwrap.dedent("""
    #include <dirent.h>
    #include <fcntl.h>
    #include <stdio.h>
    #include <stdlib.h>
    #include <string.h>
    #include <sys/mman.h>
    #include <sys/stat.h>
    #include <sys/sysmacros.h>
    #include <unistd.h>
    typedef unsigned long long ptr_t;
    typedef struct { char reserved[64]; } ipc_t;
    typedef struct { int pid, fd; ptr_t start, end, offset; } exported_t;
    static struct { ptr_t address; size_t size; } opened[64];
    /* A copy to the device from pageable memory may return before its bytes land (the
       driver's documented behaviour): the fake keeps the last one pending until the
       context is synchronized or the next copy starts behind it. */
    static struct { ptr_t device; void *bytes; size_t n; } pending;
    static void land_pending(void) {
        if (pending.bytes) {
            memcpy((void *)pending.device, pending.bytes, pending.n);
            free(pending.bytes);
            pending.bytes = NULL;
        }
    }

    int cuInit(unsigned flags) { (void)flags; return 0; }
    int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
    int cuDevicePrimaryCtxRetain(void **context, int device) {
        *context = (void *)(long)(device + 1);
        return 0;
    }
    int cuCtxSetCurrent(void *context) { (void)context; return 0; }
    int cuCtxPushCurrent_v2(void *context) { (void)context; return 0; }
    int cuCtxPopCurrent_v2(void **context) { *context = NULL; return 0; }
    int cuMemGetAddressRange_v2(ptr_t *base, size_t *size, ptr_t p) {
        char line[512];
        unsigned long long start, end;
        FILE *maps = fopen("/proc/self/maps", "r");
        while (maps && fgets(line, sizeof line, maps)) {
            if (sscanf(line, "%llx-%llx", &start, &end) == 2 && start <= p && p < end) {
                *base = start;
                *size = end - start;
                fclose(maps);
                return 0;
            }
        }
        if (maps) fclose(maps);
        return 1;                                   /* CUDA_ERROR_INVALID_VALUE */
    }
    /* The mapping holding p: its range, file offset and file (device, inode). */
    static int find_mapping(ptr_t p, exported_t *e, unsigned *major_, unsigned *minor_,
                            unsigned long *inode) {
        char line[512];
        FILE *maps = fopen("/proc/self/maps", "r");
        while (maps && fgets(line, sizeof line, maps)) {
            if (sscanf(line, "%llx-%llx %*s %llx %x:%x %lu", &e->start, &e->end, &e->offset,
                       major_, minor_, inode) == 6 && e->start <= p && p < e->end) {
                fclose(maps);
                return 0;
            }
        }
        if (maps) fclose(maps);
        return 1;
    }
    int cuIpcGetMemHandle(ipc_t *handle, ptr_t base) {
        exported_t e;
        unsigned major_, minor_;
        unsigned long inode;
        struct stat st;
        struct dirent *entry;
        DIR *fds;
        if (getenv("FAKE_CUDA_NO_IPC")) return 801; /* CUDA_ERROR_NOT_SUPPORTED */
        if (find_mapping(base, &e, &major_, &minor_, &inode) || inode == 0) return 1;
        e.pid = getpid();
        e.fd = -1;
        fds = opendir("/proc/self/fd");            /* the descriptor that holds the file */
        while (fds && (entry = readdir(fds)) != NULL) {
            int fd = atoi(entry->d_name);
            if (entry->d_name[0] != '.' && fstat(fd, &st) == 0 && st.st_ino == inode
                    && major(st.st_dev) == major_ && minor(st.st_dev) == minor_) {
                e.fd = fd;
                break;
            }
        }
        if (fds) closedir(fds);
        if (e.fd < 0) return 1;
        memset(handle, 0, sizeof *handle);
        memcpy(handle, &e, sizeof e);
        return 0;
    }
    int cuIpcOpenMemHandle_v2(ptr_t *p, ipc_t handle, unsigned flags) {
        exported_t e;
        char path[128];
        int fd, i;
        void *m;
        (void)flags;
        memcpy(&e, &handle, sizeof e);
        snprintf(path, sizeof path, "/proc/%d/fd/%d", e.pid, e.fd);
        fd = open(path, O_RDWR);
        if (fd < 0) return 400;                     /* CUDA_ERROR_INVALID_HANDLE */
        m = mmap(NULL, e.end - e.start, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                 (off_t)e.offset);
        close(fd);
        if (m == MAP_FAILED) return 2;              /* CUDA_ERROR_OUT_OF_MEMORY */
        for (i = 0; i < 64 && opened[i].address; i++) {}
        if (i == 64) return 2;
        opened[i].address = (ptr_t)m;
        opened[i].size = e.end - e.start;
        *p = (ptr_t)m;
        return 0;
    }
    int cuIpcCloseMemHandle(ptr_t p) {
        int i;
        for (i = 0; i < 64; i++) {
            if (opened[i].address == p) {
                land_pending();
                munmap((void *)p, opened[i].size);
                opened[i].address = 0;
                return 0;
            }
        }
        return 1;
    }
    int cuCtxSynchronize(void) { land_pending(); return 0; }
    int cuMemcpyDtoH_v2(void *host, ptr_t device, size_t n) {
        land_pending();
        memcpy(host, (const void *)device, n);
        return 0;
    }
    int cuMemcpyHtoD_v2(ptr_t device, const void *host, size_t n) {
        land_pending();
        pending.bytes = malloc(n);
        if (!pending.bytes) return 2;               /* CUDA_ERROR_OUT_OF_MEMORY */
        memcpy(pending.bytes, host, n);
        pending.device = device;
        pending.n = n;
        return 0;
    }
    int cuGetErrorName(int error, const char **name) {
        switch (error) {
        case 1: *name = "CUDA_ERROR_INVALID_VALUE"; return 0;
        case 400: *name = "CUDA_ERROR_INVALID_HANDLE"; return 0;
        case 801: *name = "CUDA_ERROR_NOT_SUPPORTED"; return 0;
        default: return 1;
        }
    }
""")

FAKE_CUFILE = textwrap.dedent("""
    #include <errno.h>
    #include <stdint.h>
    #include <stdio.h>
    #include <stdlib.h>
    #include <string.h>
    #include <unistd.h>
    typedef struct { int err; int cu_err; } status;
    typedef struct { int type; union { int fd; void *handle; } handle; const void *ops; } descr;
    static struct { const char *address; size_t size; } registered[64];

    static status make(int err) { status s = {err, 0}; return s; }
    status cuFileDriverOpen(void) {
        char text[4096] = "";
        const char *path = getenv("CUFILE_ENV_PATH_JSON");
        FILE *config = path ? fopen(path, "r") : NULL;
        if (config) {
            text[fread(text, 1, sizeof text - 1, config)] = 0;
            fclose(config);
        }
        return make(strstr(text, "fail_driver_open") ? 5002 : 0);
    }
    status cuFileDriverClose(void) { return make(0); }
    status cuFileHandleRegister(void **handle, descr *d) {
        /* A cloud VM without nvidia-fs refuses every file: HANDLE_NOT_REGISTERED (5027);
           FAKE_CUFILE_REFUSE_MATCHING limits it to paths that contain a string. */
        const char *refuse = getenv("FAKE_CUFILE_REFUSE_FILES");
        const char *matching = getenv("FAKE_CUFILE_REFUSE_MATCHING");
        char link[64], path[4096];
        ssize_t length;
        snprintf(link, sizeof link, "/proc/self/fd/%d", d->handle.fd);
        length = readlink(link, path, sizeof path - 1);
        path[length > 0 ? length : 0] = 0;
        if (refuse && (!matching || strstr(path, matching))) return make(atoi(refuse));
        *handle = (void *)(intptr_t)(d->handle.fd + 1);
        return make(0);
    }
    void cuFileHandleDeregister(void *handle) { (void)handle; }
    status cuFileBufRegister(const void *p, size_t n, int flags) {
        int i, free_slot = -1;
        (void)flags;
        if (getenv("FAKE_CUFILE_REFUSE_REGISTRATION")) return make(5025); /* PERMISSION_DENIED */
        for (i = 0; i < 64; i++) {
            if (registered[i].address == p) return make(5023);  /* ALREADY_REGISTERED */
            if (!registered[i].address && free_slot < 0) free_slot = i;
        }
        registered[free_slot].address = p;
        registered[free_slot].size = n;
        return make(0);
    }
    status cuFileBufDeregister(const void *p) {
        int i;
        for (i = 0; i < 64; i++) {
            if (registered[i].address == p) { registered[i].address = NULL; return make(0); }
        }
        return make(5024);                                      /* MEMORY_NOT_REGISTERED */
    }
    static int check(const char *base, off_t base_off, size_t n) {
        int i;
        for (i = 0; i < 64; i++) {
            if (registered[i].address == base) {
                return (size_t)base_off + n <= registered[i].size ? 0 : -5014;
            }
        }
        return getenv("FAKE_CUFILE_REGISTERED_ONLY") ? -5024 : 0;
    }
    /* Like compat mode: the device side goes through an aligned host bounce buffer,
       the file side is plain O_DIRECT (so unaligned file offsets fail with EINVAL). */
    ssize_t cuFileRead(void *h, void *base, size_t n, off_t off, off_t base_off) {
        void *bounce;
        ssize_t got;
        int err = check(base, base_off, n);
        if (err) return err;
        if (posix_memalign(&bounce, 4096, n ? n : 1)) { errno = ENOMEM; return -1; }
        got = pread((int)(intptr_t)h - 1, bounce, n, off);
        if (got > 0) memcpy((char *)base + base_off, bounce, (size_t)got);
        free(bounce);
        return got;
    }
    ssize_t cuFileWrite(void *h, const void *base, size_t n, off_t off, off_t base_off) {
        void *bounce;
        ssize_t put;
        int err = check(base, base_off, n);
        if (err) return err;
        if (posix_memalign(&bounce, 4096, n ? n : 1)) { errno = ENOMEM; return -1; }
        memcpy(bounce, (const char *)base + base_off, n);
        put = pwrite((int)(intptr_t)h - 1, bounce, n, off);
        free(bounce);
        return put;
    }
""")


def build(folder, name, source):
    """Compile ``source`` into the shared library ``folder/name``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the fake GPU libraries")
    source_file = folder / f"{name}.c"
    source_file.write_text(source)
    library = folder / name
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source_file)],
                   check=True)
    return library
