"""DeepSpeed's op builders: ``AsyncIOBuilder().load().aio_handle(...)`` works as is."""
import types

from .aio import aio_handle
from .gds import gds_handle
from .gpu.discovery import gds_available


class AsyncIOBuilder:
    """Stands in for ``deepspeed.ops.op_builder.AsyncIOBuilder``; nothing is compiled."""

    NAME = "async_io"

    def is_compatible(self, verbose=False):
        return True

    def load(self, verbose=True):
        return types.SimpleNamespace(aio_handle=aio_handle)


class GDSBuilder:
    """Stands in for ``deepspeed.ops.op_builder.GDSBuilder``; nothing is compiled.

    ``is_compatible()`` says whether cuFile loads here; ``load().gds_handle`` works
    either way (without cuFile it moves CUDA tensors as aio_handle does, with a warning).
    """

    NAME = "gds"

    def is_compatible(self, verbose=False):
        return gds_available()

    def load(self, verbose=True):
        return types.SimpleNamespace(gds_handle=gds_handle, aio_handle=aio_handle)
