"""Check a plot at the size it is written: no text clipped at the figure's edge, no two texts
overlapping. Used by tests/report/test_plots.py (report plots) and
tests/benchmarks/test_benchmarks_plot.py.

The figure is drawn at the resolution it is saved with; every ``Text`` that matplotlib
actually draws (titles, labels, tick labels, legend entries, notes) is recorded with its
extent in pixels, then each is checked against the figure's box and against the others.
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: pixels a text may cross the edge or another text by (anti-aliasing, rounding)
TOLERANCE_PX = 1.0


class DrawnText(NamedTuple):
    text: str
    x0: float
    y0: float
    x1: float
    y1: float


def drawn_texts(fig: Any, dpi: float) -> list[DrawnText]:
    """Draw ``fig`` at ``dpi`` and return each non-empty text drawn, with its window extent."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    FigureCanvasAgg(fig)
    fig.set_dpi(dpi)
    drawn: list[Text] = []
    original = Text.draw

    def record(self: Text, renderer: Any) -> None:
        original(self, renderer)
        if self.get_visible() and self.get_text().strip():
            drawn.append(self)

    Text.draw = record  # type: ignore[method-assign]
    try:
        fig.canvas.draw()
    finally:
        Text.draw = original  # type: ignore[method-assign]
    renderer = fig.canvas.get_renderer()
    out = []
    for t in drawn:
        box = t.get_window_extent(renderer)
        out.append(DrawnText(t.get_text(), box.x0, box.y0, box.x1, box.y1))
    return out


def text_problems(fig: Any, dpi: float) -> list[str]:
    """Clipped and overlapping texts of ``fig`` drawn at ``dpi``, one line each (empty: fine)."""
    texts = drawn_texts(fig, dpi)
    width, height = fig.bbox.width, fig.bbox.height
    tol = TOLERANCE_PX
    problems = []
    for t in texts:
        if t.x0 < -tol or t.y0 < -tol or t.x1 > width + tol or t.y1 > height + tol:
            problems.append(f"clipped: {t.text!r} at x {t.x0:.0f}..{t.x1:.0f}, "
                            f"y {t.y0:.0f}..{t.y1:.0f} in a {width:.0f} x {height:.0f} figure")
    for k, a in enumerate(texts):
        for b in texts[k + 1:]:
            dx = min(a.x1, b.x1) - max(a.x0, b.x0)
            dy = min(a.y1, b.y1) - max(a.y0, b.y0)
            if dx > tol and dy > tol:
                problems.append(f"overlap: {a.text!r} and {b.text!r} ({dx:.0f} x {dy:.0f} px)")
    return problems
