/* Filling a table of function pointers from a shared library found at run time.
 *
 * The shims of the optional libraries (cuFile, the CUDA driver) use it, so that
 * nvmeswap neither links against them nor needs them to build or import.
 */
#ifndef NVMESWAP_DLOPEN_TABLE_H
#define NVMESWAP_DLOPEN_TABLE_H

#include <dlfcn.h>
#include <stdio.h>
#include <stddef.h>

/* dlopen ``path`` and resolve ``count`` symbols into ``slots``: all of them or none.
 * Returns the library, or NULL with ``why`` set (the slots are then left NULL). */
static inline void *nvmeswap_dlopen_table(const char *path, const char *const *names,
                                          void ***slots, size_t count, char *why,
                                          size_t why_len)
{
    size_t i;
    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        snprintf(why, why_len, "%s", dlerror());
        return NULL;
    }
    for (i = 0; i < count; i++) {
        *slots[i] = dlsym(library, names[i]);
        if (*slots[i] == NULL) {
            snprintf(why, why_len, "%s has no %s", path, names[i]);
            for (i = 0; i < count; i++) {
                *slots[i] = NULL;
            }
            dlclose(library);
            return NULL;
        }
    }
    return library;
}

#endif
