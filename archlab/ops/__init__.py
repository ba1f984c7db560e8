"""Pure-PyTorch stand-ins for the CUDA/Triton sequence-mixing kernels (same names, arguments and layouts)."""
