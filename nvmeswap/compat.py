"""DeepSpeed's op-builder entry point: ``AsyncIOBuilder().load().aio_handle(...)`` works as is."""
import types

from .handle import aio_handle


class AsyncIOBuilder:
    """Stands in for ``deepspeed.ops.op_builder.AsyncIOBuilder``; nothing is compiled."""

    NAME = "async_io"

    def is_compatible(self, verbose=False):
        return True

    def load(self, verbose=True):
        return types.SimpleNamespace(aio_handle=aio_handle)


class GDSBuilder:
    """Stands in for ``deepspeed.ops.op_builder.GDSBuilder``.

    This version of nvmeswap loads cuFile (``nvmeswap.gds_available()``) but has no
    ``gds_handle`` yet, so it reports itself incompatible, as DeepSpeed does where GDS
    cannot be built, and callers fall back to ``AsyncIOBuilder``.
    """

    NAME = "gds"

    def is_compatible(self, verbose=False):
        return False

    def load(self, verbose=True):
        raise RuntimeError("nvmeswap has no gds_handle in this version; use "
                           "AsyncIOBuilder().load().aio_handle(...)")
