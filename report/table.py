"""Plain-text tables for the terminal."""

from collections.abc import Sequence


def _cell(value) -> str:
  if isinstance(value, float):
    if value == 0:
      return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
      return f"{value:.3g}"
    return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
  return str(value)


def key_values(title: str, rows: Sequence[tuple[str, object]]) -> str:
  width = max(len(k) for k, _ in rows)
  lines = [title, "-" * len(title)]
  lines += [f"{k:<{width}}  {_cell(v)}" for k, v in rows]
  return "\n".join(lines)


def columns(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  cells = [[_cell(v) for v in row] for row in rows]
  widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
  line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))
  return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])
