"""Rows of results as markdown, CSV or JSON, the three formats every report command offers."""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal, InvalidOperation
from enum import Enum

MIB = 2**20  # the tables' memory columns are MiB


class Format(str, Enum):
    md = "md"
    csv = "csv"
    json = "json"


def first_few(items: list[str], most: int, sep: str = ", ") -> str:
    """Up to ``most`` of ``items``, then how many more: a message names a few of many, not each."""
    return sep.join(items[:most]) + (f"{sep}and {len(items) - most:,} more" if len(items) > most else "")


def _three_digits(value: float) -> str:
    """Three significant digits, trailing zeros kept so a column reads alike: 4.00 beside 16.0."""
    return f"{value:#.3g}".rstrip(".") if value else "0"


class Decimals(float):
    """A number shown to a fixed count of decimals (losses that differ in the third place); a
    plain number in JSON and CSV."""

    def __new__(cls, value: float, places: int):
        number = super().__new__(cls, round(value, places) + 0.0)  # + 0.0: a -0.0 (a loss gain of -0.00001) shows as 0
        number.places = places
        return number


def _cell(value) -> str:
    if value is None:  # not applicable (a bench row without pages has no page size)
        return "-"
    if isinstance(value, Decimals):
        return f"{value:.{value.places}f}"
    if isinstance(value, float):
        if abs(value) >= 2**53:  # past the integers a float holds: its digits would be made up
            return f"{value:.2e}"
        return f"{value:,.1f}" if abs(value) >= 10 else _three_digits(value)
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("|", "\\|")  # a name holding | (a run's folder, a spec's name) would split the row


def render(rows: list[dict], fmt: Format) -> str:
    """Rows that may differ in their columns (a recall run's accuracy beside a text run's none) as
    one table: every column any row has, empty where a row lacks it."""
    columns = list(dict.fromkeys(column for row in rows for column in row))
    rows = [{column: row.get(column) for column in columns} for row in rows]
    if fmt is Format.json:
        return json.dumps(rows, indent=2) + "\n"
    if fmt is Format.csv:
        out = io.StringIO()
        writer = csv.DictWriter(out, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    lines = ["| " + " | ".join(map(_cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def si(value: float) -> str:
    """1.29e9 -> '1.29G': three significant digits with an SI prefix."""
    value = float(f"{value:.3g}")  # round first, so 999.9 reads 1.00K, not 1.00e+03
    if abs(value) >= 1e27:  # past the last prefix
        return f"{value:.2e}"
    for prefix, scale in (("Y", 1e24), ("Z", 1e21), ("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{_three_digits(value / scale)}{prefix}"
    return _three_digits(value)


def tokens_label(n: int) -> str:
    """16384 -> '16K', the way token counts are written on the command line."""
    for suffix, scale in (("M", 1024**2), ("K", 1024)):
        if n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


LONGEST_CONTEXT = 2**30  # tokens: 4,096x the paper's longest, so that a length off by its units is refused, not costed


def parse_length(text: str) -> int:
    """'16384', '16K' or '1M' as a sequence length in tokens (K = 1024, as 256K contexts are counted)."""
    scale = {"K": 1024, "M": 1024**2}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    if not (number.isascii() and number.isdigit()) or int(number) < 1:  # not "²", which int() refuses
        raise ValueError(f"{text!r} is not a token count (examples: 2048, 16K, 256K)")
    if (length := int(number) * scale) > LONGEST_CONTEXT:
        raise ValueError(f"{text} tokens is longer than the {LONGEST_CONTEXT:,} (2^30) a context may be; check its units")
    return length


BUDGET_SCALES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_budget(text: str) -> int:
    """'50M', '1.5B' or '300B' as a number of training tokens (K, M, B or G, T = powers of 1,000, as
    budgets are counted)."""
    scale = BUDGET_SCALES.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        amount = Decimal(number) * scale
    except InvalidOperation:
        amount = None
    if amount is None or not amount.is_finite() or amount < 1 or amount != amount.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of tokens (examples: 2048, 50M, 1.5B, 300B;"
                         " K, M, B (or G) and T are powers of 1,000)")
    return int(amount)
