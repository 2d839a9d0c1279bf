"""Weight formats: the math of each format, in pure torch, registered by name."""
from .base import Format
from .registry import format_from_json, formats, get_format, register_format
from .scalar import ScalarCodebookFormat
from .uniform import Int4, IntAsym, IntSym, Q4_0
from .iq4_nl import IQ4_NL
from .q8 import Q8_0
from .palette import NUQ, TCQ, VQ, PaletteFormat, HalfTCQ
from .gcb import GroupCodebook
from .gvq import GeneralVQ
from .kquants import KQuantFormat
from . import kv, kv_vq  # noqa: F401  (the KV cache entries; register the attention ops' CPU references without the extension)

__all__ = ["Format", "ScalarCodebookFormat", "Q4_0", "Int4", "IntAsym", "IntSym", "IQ4_NL", "Q8_0", "formats", "get_format", "register_format",
           "format_from_json", "PaletteFormat", "NUQ", "VQ", "TCQ", "HalfTCQ", "GroupCodebook", "GeneralVQ", "KQuantFormat"]
