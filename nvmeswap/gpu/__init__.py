"""CUDA: finding libcuda/libcufile, copies to and from the GPU, CUDA memory for cuFile workers."""
