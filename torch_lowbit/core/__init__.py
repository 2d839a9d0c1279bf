"""The bottom layer: bits, constants and locations every other layer reads, torch only.

- packing: bit streams, int8 tiles, Q4_0 nibbles, the code widths the kernels take
- activations: activation rounding (per token, block-scaled, ggml's Q8_0 blocks), the one definition
- tcq_codes: TCQ's computed 1mad code constants and the kernels' table convention
- cache: where derived files (model conversions, autotune results) are kept
"""
