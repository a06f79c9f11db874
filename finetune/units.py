"""Byte counts for people: one formatter for every message, table and log line."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """Binary units with one decimal: 1536 -> '1.5 KiB', 225710096 -> '215.3 MiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def compact_bytes(n: float) -> str:
    """Bytes for narrow table columns: '31.0G', '62M', '12K'."""
    for unit, size in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}" if unit == "G" else f"{n / size:.0f}{unit}"
    return f"{n:.0f}B"
