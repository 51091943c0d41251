/* NVIDIA cuFile (GPUDirect Storage), loaded at run time with dlopen.
 *
 * Our own declarations of the few cuFile types nvmeswap uses, and a table of function
 * pointers filled from libcufile.so.0, so that nvmeswap builds and imports where CUDA
 * is absent (the approach of kvikio's shim/cufile.hpp).
 */
#ifndef NVMESWAP_CUFILE_SHIM_H
#define NVMESWAP_CUFILE_SHIM_H

#include <string.h>
#include <sys/types.h>

#include "dlopen_table.h"

typedef struct {
    int err;        /* CUfileOpError: 0 is success, 5001 and up are cuFile's errors */
    int cu_err;     /* CUresult, meaningful when err is CU_FILE_CUDA_DRIVER_ERROR (5011) */
} nvmeswap_CUfileError_t;

typedef void *nvmeswap_CUfileHandle_t;

typedef struct {
    int type;                               /* CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1 */
    union { int fd; void *handle; } handle;
    const void *fs_ops;
} nvmeswap_CUfileDescr_t;

typedef struct {
    void *library;
    nvmeswap_CUfileError_t (*driver_open)(void);
    nvmeswap_CUfileError_t (*driver_close)(void);
    nvmeswap_CUfileError_t (*handle_register)(nvmeswap_CUfileHandle_t *, nvmeswap_CUfileDescr_t *);
    void (*handle_deregister)(nvmeswap_CUfileHandle_t);
    nvmeswap_CUfileError_t (*buf_register)(const void *, size_t, int);
    nvmeswap_CUfileError_t (*buf_deregister)(const void *);
    ssize_t (*read)(nvmeswap_CUfileHandle_t, void *, size_t, off_t, off_t);
    ssize_t (*write)(nvmeswap_CUfileHandle_t, const void *, size_t, off_t, off_t);
} nvmeswap_cufile_table;

/* Fill ``table`` from the library at ``path``; 0 on success, else -1 with ``why`` set. */
static inline int nvmeswap_cufile_load(const char *path, nvmeswap_cufile_table *table,
                                       char *why, size_t why_len)
{
    const char *names[] = {"cuFileDriverOpen", "cuFileDriverClose", "cuFileHandleRegister",
                           "cuFileHandleDeregister", "cuFileBufRegister", "cuFileBufDeregister",
                           "cuFileRead", "cuFileWrite"};
    void **slots[] = {(void **)&table->driver_open, (void **)&table->driver_close,
                      (void **)&table->handle_register, (void **)&table->handle_deregister,
                      (void **)&table->buf_register, (void **)&table->buf_deregister,
                      (void **)&table->read, (void **)&table->write};
    memset(table, 0, sizeof(*table));
    table->library = nvmeswap_dlopen_table(path, names, slots, sizeof(names) / sizeof(names[0]),
                                           why, why_len);
    return table->library == NULL ? -1 : 0;
}

#endif
