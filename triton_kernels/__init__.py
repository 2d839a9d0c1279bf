"""Triton GPU kernels of torch_lowbit, installed as torch_lowbit.triton_kernels.

Kernels take packed buffers and sizes (never format objects). On CPU they run only under the Triton
interpreter (TRITON_INTERPRET=1), which is how the test-suite checks them without a GPU.
"""
