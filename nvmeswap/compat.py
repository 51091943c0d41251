"""The name DeepSpeed users first met: ``from nvmeswap.compat import AsyncIOBuilder``."""
from .deepspeed import AsyncIOBuilder, GDSBuilder, PinMemoryBuilder, install, uninstall

__all__ = ["AsyncIOBuilder", "GDSBuilder", "PinMemoryBuilder", "install", "uninstall"]
