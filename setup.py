"""Builds nvmeswap's Cython extensions; needs only setuptools, Cython and a C compiler."""
import glob

from Cython.Build import cythonize
from setuptools import Extension, setup


def extension(name, libraries=()):
    return Extension(
        f"nvmeswap._{name}",
        sources=[f"pyx/_{name}.pyx"],
        include_dirs=["cdeps"],
        depends=sorted(glob.glob("cdeps/*.h")),     # rebuilt when a header changes
        libraries=list(libraries),
        extra_compile_args=["-O2"],
    )


setup(
    ext_modules=cythonize(
        [extension("queues", libraries=["pthread"]), extension("uring"), extension("transfers"),
         extension("memory", libraries=["pthread"]),
         extension("cufile", libraries=["dl"]), extension("cuda", libraries=["dl"]),
         extension("collection")],
        include_path=["pyx"],
        compiler_directives={"language_level": "3"},
    ),
)
