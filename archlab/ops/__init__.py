"""The blocks' core ops: pure-PyTorch versions of the CUDA/Triton sequence-mixing kernels (same
names, arguments and layouts), softmax attention and its masks, and ``dispatch``, which picks a
kernel or the PyTorch op for each block."""
