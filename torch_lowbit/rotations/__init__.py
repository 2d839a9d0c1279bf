"""Rotations for incoherence processing: randomized Hadamard transforms (QuaRot / QuIP# style)."""
from .hadamard import (SUPPORTED_BASE_ORDERS, base_hadamard_matrix, base_order, hadamard_matrix,
                       hadamard_transform_reference, random_signs, supported_hadamard_size)
from .ops import hadamard_transform  # the op (registers the base matrices, fake and CUDA impls)
from .model import SUPPORTED_MODEL_TYPES, OnlineHadamardLinear, rotate_
from .smooth import smooth_down_proj_

__all__ = ["SUPPORTED_BASE_ORDERS", "base_hadamard_matrix", "base_order", "hadamard_matrix",
           "hadamard_transform", "hadamard_transform_reference", "random_signs", "supported_hadamard_size",
           "rotate_", "OnlineHadamardLinear", "SUPPORTED_MODEL_TYPES", "smooth_down_proj_"]
