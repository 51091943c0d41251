"""Offloading training state: swap tensors out to files and back, and an optimizer whose
state lives on disk between steps."""
from .offload import OffloadedOptimizer, OffloadedState
from .swap import SwapBufferPool, SwapError, SwapState, TensorSwapper

__all__ = ["OffloadedOptimizer", "OffloadedState", "SwapBufferPool", "SwapError", "SwapState",
           "TensorSwapper"]
