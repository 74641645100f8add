"""Plain-text and markdown tables: the one writer of each, used by every report (imports nothing)."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(rows: Sequence[Sequence[object]], right_from: int | None = None) -> str:
    """Header row, a rule, then aligned rows; columns from ``right_from`` on are right-aligned (numbers)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]

    def line(row: list[str]) -> str:
        right = right_from if right_from is not None else len(row)
        return "  ".join(
            c.rjust(w) if i >= right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join(
        [line(cells[0]).rstrip(), "  ".join("-" * w for w in widths), *(line(r).rstrip() for r in cells[1:])]
    )


def markdown_table(header: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table (no trailing newline): the one writer behind every markdown report."""
    lines = ["| " + " | ".join(str(c) for c in header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])
