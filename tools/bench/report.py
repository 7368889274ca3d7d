"""Printing benchmark results the same way everywhere: a GB/s table and ratio lines against targets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def print_rates(cols: Sequence[str], rates: Mapping[str, Sequence[float]]) -> None:
    """One row of GB/s per contender, one column per measurement."""
    print(f"{'GB/s':10}" + "".join(f"{c:>12}" for c in cols))
    for name, gbs in rates.items():
        print(f"{name:10}" + "".join(f"{g:12.2f}" for g in gbs))


def print_ratios(cols: Sequence[str], mine: Sequence[float], other: Sequence[float], label: str,
                 target: float | None) -> None:
    """`mine / other` for every column (both in GB/s), against `target` (None: no issue sets one)."""
    ratios = "  ".join(f"{c} {m / o:.2f}x" for c, m, o in zip(cols, mine, other, strict=True))
    print(f"{label}: {ratios}  " + (f"(target >= {target}x)" if target is not None else "(no target)"))
