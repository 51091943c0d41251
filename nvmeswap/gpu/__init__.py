"""CUDA primitives: finding libcuda/libcufile, copies to and from the GPU, CUDA IPC of memory."""
