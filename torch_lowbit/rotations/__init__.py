"""Rotations for incoherence processing: randomized Hadamard transforms (QuaRot / QuIP# style)."""
from . import ops as _ops  # noqa: F401  (registers the base matrices, fake and CUDA impls of the op)
from .hadamard import (SUPPORTED_BASE_ORDERS, base_hadamard_matrix, base_order, hadamard_matrix,
                       hadamard_transform, hadamard_transform_reference, random_signs,
                       supported_hadamard_size)

__all__ = ["SUPPORTED_BASE_ORDERS", "base_hadamard_matrix", "base_order", "hadamard_matrix",
           "hadamard_transform", "hadamard_transform_reference", "random_signs", "supported_hadamard_size"]
