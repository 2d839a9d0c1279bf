"""Weight formats: the math of each format, in pure torch, registered by name."""
from .base import Format
from .registry import format_from_json, formats, get_format, register_format
from .scalar import ScalarCodebookFormat
from .uniform import Int4, Q4_0
from .lut import IQ4_NL

__all__ = ["Format", "ScalarCodebookFormat", "Q4_0", "Int4", "IQ4_NL", "formats", "get_format", "register_format",
           "format_from_json"]
