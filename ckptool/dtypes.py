"""Dtype names and sizes, without importing torch.

Maps the names a checkpoint uses for element types (legacy storage classes
such as ``torch.FloatStorage``, ``torch.<dtype>`` globals, safetensors codes)
onto one canonical name per dtype, the one torch prints without its
``torch.`` prefix (``float32``, ``bfloat16``, ``float8_e4m3fn``...).
"""

from __future__ import annotations

# canonical name -> bytes per element (sub-byte dtypes report 1: they are
# packed, and their storages count bytes)
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
    "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1, "uint6": 1,
    "uint7": 1,
}

# torch's aliases for the same dtypes (torch.float == torch.float32 ...)
_ALIASES = {
    "float": "float32", "double": "float64", "half": "float16",
    "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32",
    "long": "int64", "int": "int32", "short": "int16",
}

# legacy typed storage class name -> dtype
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32",
    "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8", "QUInt8Storage": "quint8", "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
    # untyped storages count bytes; the tensor's dtype comes separately
    "UntypedStorage": "uint8", "TypedStorage": "uint8",
}

SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}

FLOATING = frozenset({
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
})
COMPLEX = frozenset({"complex128", "complex64", "complex32"})
QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})


def canonical(name: str) -> str | None:
    """The canonical dtype name for ``name`` (``float`` -> ``float32``), or None."""
    name = _ALIASES.get(name, name)
    return name if name in ITEMSIZE else None


def itemsize(dtype: str) -> int:
    return ITEMSIZE.get(dtype, 1)


def is_floating(dtype: str) -> bool:
    """True for real floating dtypes and complex ones (both hold weights)."""
    return dtype in FLOATING or dtype in COMPLEX
