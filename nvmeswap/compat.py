"""The name DeepSpeed users first met: ``from nvmeswap.compat import AsyncIOBuilder``."""
from .deepspeed import AsyncIOBuilder, GDSBuilder

__all__ = ["AsyncIOBuilder", "GDSBuilder"]
