"""TCQ's computed 1mad code: the constants and the kernels' table convention, at the bottom layer because
the op checks (ops/palette.py) and the Triton decoder (triton_kernels/palette.py) read them too;
formats/tcq.py holds the rest of the TCQ math and re-exports these.

Coordinate c of a 16-bit trellis state's value is (bytesum((A_c * state + B_c) mod 2**32) - 510) / 128
(QTIP's 1MAD code, made two-dimensional; formats/tcq.py explains it)."""
from __future__ import annotations

MAD_MULTIPLIERS = (34038481, 3188803409)  # A_0 (QTIP's 1MAD a), A_1
MAD_INCREMENTS = (76625530, 1013904223)  # B_0 (QTIP's 1MAD b), B_1
MAD_OFFSET = 510  # the mean of a sum of four uniform bytes
MAD_UNIT = 1 / 128  # value units: exact in fp32
MAD_TABLE_BITS = 0  # the kernels' table_bits for the 1mad code: no table (an empty [0, 2] one)


def kernel_table_shape(table_bits: int) -> tuple[int, int]:
    """The shape of the TCQ kernels' table argument for table_bits: the hybrid code's signed table
    [2^(table_bits + 1), 2], or [0, 2] for the 1mad code (formats/tcq.py tcq_kernel_table)."""
    return (0, 2) if table_bits == MAD_TABLE_BITS else (2 << table_bits, 2)
