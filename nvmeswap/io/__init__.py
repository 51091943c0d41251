"""The I/O path of both handles: operations, their chunk plan, memory, and the scheduler."""
