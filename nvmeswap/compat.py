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
