"""Pictures of a pipeline frequency plan, for people to look at.

One row per stage (GPU); each computation is a box placed at its start time (as early as its
dependencies allow, see :func:`~joules.optimizers.pipeline.frontier.timeline`), as wide as it
lasts at the plan's frequency, filled with that frequency's colour on a viridis-like ramp (dark
blue is the lowest profiled clock, yellow the highest). Backward computations are hatched with a
thick dark border; forward ones have a thin border of a darker shade of their fill. Grey lanes
show where a GPU is idle, blocked on its neighbours. A time axis in ms, a colour bar in MHz, a
legend and a title with the iteration time and energy complete it.

:func:`to_svg` writes SVG by hand and :func:`to_png` draws a PNG with numpy and ``zlib`` (with
a small built-in bitmap font); neither needs a plotting library. :func:`save_picture` picks the
format from the file suffix.
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

from joules.optimizers.pipeline.frontier import Plan, PlanError, chosen_options, timeline
from joules.optimizers.pipeline.profile import PipelineProfile
from joules.optimizers.pipeline.schedule import Computation, PipelineDAG

if TYPE_CHECKING:
    import numpy as np

FORMATS = (".svg", ".png")

#: Control points of the colour ramp (viridis, sampled at nine evenly spaced points).
RAMP: tuple[tuple[int, int, int], ...] = (
    (0x44, 0x01, 0x54), (0x47, 0x2C, 0x7A), (0x3B, 0x51, 0x8B), (0x2C, 0x71, 0x8E), (0x21, 0x90, 0x8D),
    (0x27, 0xAD, 0x81), (0x5C, 0xC8, 0x63), (0xAA, 0xDC, 0x32), (0xFD, 0xE7, 0x25),
)

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
INK: Color = (34, 34, 34)
LANE: Color = (236, 236, 236)
BACKWARD_BORDER: Color = (20, 20, 20)


# -- what to draw ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Box:
    """One computation of a plan, placed in time.

    Attributes:
        node: DAG node id.
        computation: The computation.
        frequency: Its SM frequency in the plan, MHz.
        start_s: When it starts, s from the start of the iteration.
        end_s: When it ends, s.
    """

    node: int
    computation: Computation
    frequency: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        """How long it runs, s."""
        return self.end_s - self.start_s


_XML_INVALID = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def schedule_boxes(dag: PipelineDAG, profile: PipelineProfile, plan: Plan) -> list[Box]:
    """Every computation of ``plan`` with its start and end time, by node id.

    Durations are the profiled times at the plan's frequencies; start times are the earliest
    the DAG allows.

    Raises:
        PipelineProfileError: The profile does not cover the pipeline's stages.
        PlanError: The plan does not fit the DAG, or uses a frequency the profile lacks.
    """
    tl = timeline(dag, [o.time_s for o in chosen_options(dag, profile, plan.frequencies)])
    return [
        Box(node, c, plan.frequencies[node], tl.start_s[node], tl.end_s[node])
        for node, c in enumerate(dag.nodes)
    ]


def ramp(x: float) -> Color:
    """The colour at ``x`` in ``[0, 1]`` on the viridis-like ramp (clamped outside)."""
    x = min(1.0, max(0.0, x)) if math.isfinite(x) else 0.0
    pos = x * (len(RAMP) - 1)
    i = min(int(pos), len(RAMP) - 2)
    frac = pos - i
    a, b = RAMP[i], RAMP[i + 1]
    return (
        int(round(a[0] + (b[0] - a[0]) * frac)),
        int(round(a[1] + (b[1] - a[1]) * frac)),
        int(round(a[2] + (b[2] - a[2]) * frac)),
    )


def frequency_color(frequency: float, low_mhz: float, high_mhz: float) -> Color:
    """The fill colour of ``frequency`` when the colour bar spans ``low_mhz`` to ``high_mhz``.

    With a single frequency (``high_mhz <= low_mhz``) every box gets the top of the ramp.
    """
    if high_mhz <= low_mhz:
        return ramp(1.0)
    return ramp((frequency - low_mhz) / (high_mhz - low_mhz))


def hex_color(color: Color) -> str:
    """``#rrggbb`` of an RGB triple."""
    return "#{:02x}{:02x}{:02x}".format(*color)


def _shade(color: Color, factor: float) -> Color:
    return (int(color[0] * factor), int(color[1] * factor), int(color[2] * factor))


def _text_color(fill: Color) -> Color:
    luminance = 0.2126 * fill[0] + 0.7152 * fill[1] + 0.0722 * fill[2]
    return BLACK if luminance > 140 else WHITE


def nice_ticks(high: float, target: int = 8, low: float = 0.0) -> list[float]:
    """Round tick values from ``low`` to ``high`` (inclusive), about ``target`` of them."""
    span = high - low
    if not (math.isfinite(span) and span > 0):
        return [low]
    raw = span / max(1, target)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(low / step - 1e-9)
    ticks = []
    k = first
    while k * step <= high + step * 1e-9 and len(ticks) <= 4 * target + 2:
        ticks.append(round(k * step, 10) if step >= 1e-9 else k * step)
        k += 1
    return ticks


def _tick_label(v: float) -> str:
    text = f"{v:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def default_title(dag: PipelineDAG, plan: Plan, time_s: float) -> str:
    """The picture's default title: pipeline shape, iteration time and energy (ASCII only)."""
    e = plan.energy_j
    energy = f"{e:,.0f} J" if e >= 100 else f"{e:.3g} J"
    return (
        f"{dag.schedule} pipeline, {dag.stages} stages x {dag.microbatches} microbatches: "
        f"iteration {time_s * 1e3:,.1f} ms, {energy}"
    )


@dataclass(frozen=True)
class _Layout:
    width: int
    height: int
    left: int
    right: int
    top: int
    row_h: int
    row_gap: int
    axis_y: int
    legend_y: int
    bar_x: int
    bar_w: int
    bar_y0: int
    bar_y1: int
    time_s: float
    low_mhz: int
    high_mhz: int

    def x(self, t: float) -> float:
        if self.time_s <= 0:
            return float(self.left)
        return self.left + t / self.time_s * (self.right - self.left)

    def row_y(self, stage: int) -> int:
        return self.top + stage * (self.row_h + self.row_gap)

    def bar_y(self, mhz: float) -> float:
        if self.high_mhz <= self.low_mhz:
            return float(self.bar_y0)
        frac = (mhz - self.low_mhz) / (self.high_mhz - self.low_mhz)
        return self.bar_y1 - frac * (self.bar_y1 - self.bar_y0)


def _layout(stages: int, time_s: float, freqs: Sequence[int], width: int, row_height: int) -> _Layout:
    if width < 320:
        raise ValueError(f"picture width {width} is too small (at least 320 pixels)")
    if row_height < 6:
        raise ValueError(f"row height {row_height} is too small (at least 6 pixels)")
    left, top, gap = 64, 44, max(2, row_height // 6)
    right = width - 110
    rows_h = stages * row_height + (stages - 1) * gap
    axis_y = top + rows_h + 6
    legend_y = axis_y + 46
    bar_y0 = top
    bar_y1 = top + max(rows_h, 110)
    height = max(legend_y + 30, bar_y1 + 16)
    return _Layout(width, height, left, right, top, row_height, gap, axis_y, legend_y, right + 34, 16,
                   bar_y0, bar_y1, time_s, min(freqs), max(freqs))


def _prepare(
    dag: PipelineDAG, profile: PipelineProfile, plan: Plan, width: int, row_height: int,
    frequency_range: tuple[int, int] | None,
) -> tuple[list[Box], _Layout]:
    boxes = schedule_boxes(dag, profile, plan)
    time_s = max((b.end_s for b in boxes), default=0.0)
    freqs = list(frequency_range) if frequency_range is not None else profile.frequencies()
    return boxes, _layout(dag.stages, time_s, freqs, width, row_height)


def _label_fits(label: str, width_px: float, char_px: float, row_h: int, min_h: int) -> bool:
    return width_px >= len(label) * char_px + 6 and row_h >= min_h


# -- SVG -------------------------------------------------------------------------------------

def _n(v: float) -> str:
    text = f"{v:.3f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def to_svg(
    dag: PipelineDAG,
    profile: PipelineProfile,
    plan: Plan,
    *,
    title: str | None = None,
    width: int = 1000,
    row_height: int = 36,
    frequency_range: tuple[int, int] | None = None,
) -> str:
    """The plan's schedule as an SVG document.

    Every computation is a ``<rect class="computation forward|backward">`` carrying
    ``data-node``, ``data-stage``, ``data-microbatch``, ``data-frequency``, ``data-start-ms`` and
    ``data-end-ms`` attributes and a ``<title>`` tooltip; backward ones get a hatched overlay
    ``<rect class="hatch">``; wide enough boxes a ``<text class="label">`` such as ``F3``.

    Args:
        dag: The pipeline.
        profile: The profile the plan's frequencies come from (it gives the durations).
        plan: The plan to draw.
        title: Title (default: schedule, shape, iteration time and energy).
        width: Picture width, pixels.
        row_height: Height of one stage's row, pixels.
        frequency_range: ``(low, high)`` MHz of the colour bar (default: the profile's range).

    Raises:
        PipelineProfileError: The profile does not cover the pipeline.
        PlanError: The plan does not fit the pipeline or the profile.
        ValueError: ``width`` or ``row_height`` too small.
    """
    boxes, lay = _prepare(dag, profile, plan, width, row_height, frequency_range)
    title = default_title(dag, plan, lay.time_s) if title is None else title
    title = _XML_INVALID.sub("\ufffd", title)  # characters XML 1.0 cannot hold (control codes)
    out: list[str] = []
    add = out.append
    add(f'<svg xmlns="http://www.w3.org/2000/svg" width="{lay.width}" height="{lay.height}" '
        f'viewBox="0 0 {lay.width} {lay.height}" font-family="Helvetica, Arial, sans-serif" font-size="12">')
    add(f"<title>{escape(title)}</title>")
    add("<defs>")
    add('<linearGradient id="frequency-ramp" x1="0" y1="1" x2="0" y2="0">')
    for i, c in enumerate(RAMP):
        add(f'<stop offset="{_n(i / (len(RAMP) - 1))}" stop-color="{hex_color(c)}"/>')
    add("</linearGradient>")
    add('<pattern id="backward-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)">'
        '<rect width="2" height="6" fill="#ffffff" fill-opacity="0.35"/></pattern>')
    add("</defs>")
    add(f'<rect class="background" width="{lay.width}" height="{lay.height}" fill="#ffffff"/>')
    add(f'<text class="title" x="{lay.left}" y="24" font-size="15" font-weight="bold" '
        f'fill="{hex_color(INK)}">{escape(title)}</text>')

    plot_w = lay.right - lay.left
    for s in range(dag.stages):
        y = lay.row_y(s)
        add(f'<rect class="lane" x="{lay.left}" y="{y}" width="{plot_w}" height="{lay.row_h}" '
            f'fill="{hex_color(LANE)}"/>')
        add(f'<text class="stage-label" x="{lay.left - 8}" y="{_n(y + lay.row_h / 2)}" text-anchor="end" '
            f'dominant-baseline="central" fill="{hex_color(INK)}">GPU {s}</text>')

    for b in boxes:
        c = b.computation
        x0, x1 = lay.x(b.start_s), lay.x(b.end_s)
        y = lay.row_y(c.stage)
        fill = frequency_color(b.frequency, lay.low_mhz, lay.high_mhz)
        backward = c.kind == "backward"
        stroke = BACKWARD_BORDER if backward else _shade(fill, 0.55)
        tip = (f"GPU {c.stage} {c.kind} of microbatch {c.microbatch}: {b.frequency} MHz, "
               f"{b.duration_s * 1e3:.2f} ms, {b.start_s * 1e3:.2f} to {b.end_s * 1e3:.2f} ms")
        add(f'<rect class="computation {c.kind}" data-node="{b.node}" data-stage="{c.stage}" '
            f'data-microbatch="{c.microbatch}" data-frequency="{b.frequency}" '
            f'data-start-ms="{b.start_s * 1e3!r}" data-end-ms="{b.end_s * 1e3!r}" '
            f'x="{_n(x0)}" y="{y}" width="{_n(x1 - x0)}" height="{lay.row_h}" fill="{hex_color(fill)}" '
            f'stroke="{hex_color(stroke)}" stroke-width="{2 if backward else 1}">'
            f"<title>{escape(tip)}</title></rect>")
        if backward:
            add(f'<rect class="hatch" x="{_n(x0)}" y="{y}" width="{_n(x1 - x0)}" height="{lay.row_h}" '
                f'fill="url(#backward-hatch)" pointer-events="none"/>')
        if _label_fits(c.name, x1 - x0, 7.0, lay.row_h, 14):
            add(f'<text class="label" x="{_n((x0 + x1) / 2)}" y="{_n(y + lay.row_h / 2)}" '
                f'text-anchor="middle" dominant-baseline="central" font-size="11" '
                f'fill="{hex_color(_text_color(fill))}" pointer-events="none">{c.name}</text>')

    # Time axis.
    ink = hex_color(INK)
    add(f'<line class="axis" x1="{lay.left}" y1="{lay.axis_y}" x2="{lay.right}" y2="{lay.axis_y}" '
        f'stroke="{ink}"/>')
    for t_ms in nice_ticks(lay.time_s * 1e3):
        x = _n(lay.x(t_ms / 1e3))
        add(f'<line class="tick" x1="{x}" y1="{lay.axis_y}" x2="{x}" y2="{lay.axis_y + 5}" stroke="{ink}"/>')
        add(f'<text class="tick-label" x="{x}" y="{lay.axis_y + 18}" text-anchor="middle" '
            f'fill="{ink}">{_tick_label(t_ms)}</text>')
    add(f'<text class="axis-label" x="{_n((lay.left + lay.right) / 2)}" y="{lay.axis_y + 34}" '
        f'text-anchor="middle" fill="{ink}">time (ms)</text>')

    # Colour bar.
    add(f'<text class="colorbar-label" x="{lay.bar_x}" y="{lay.bar_y0 - 8}" fill="{ink}">MHz</text>')
    add(f'<rect class="colorbar" x="{lay.bar_x}" y="{lay.bar_y0}" width="{lay.bar_w}" '
        f'height="{lay.bar_y1 - lay.bar_y0}" fill="url(#frequency-ramp)" stroke="{ink}"/>')
    for mhz in _bar_ticks(lay):
        y = _n(lay.bar_y(mhz))
        add(f'<line class="colorbar-tick" x1="{lay.bar_x + lay.bar_w}" y1="{y}" '
            f'x2="{lay.bar_x + lay.bar_w + 4}" y2="{y}" stroke="{ink}"/>')
        add(f'<text class="colorbar-tick-label" x="{lay.bar_x + lay.bar_w + 7}" y="{y}" '
            f'dominant-baseline="central" font-size="11" fill="{ink}">{_tick_label(mhz)}</text>')

    # Legend.
    mid = hex_color(ramp(0.5))
    ly = lay.legend_y
    x = lay.left
    add(f'<rect class="legend-swatch" x="{x}" y="{ly}" width="28" height="14" fill="{mid}" '
        f'stroke="{hex_color(_shade(ramp(0.5), 0.55))}"/>')
    add(f'<text class="legend" x="{x + 34}" y="{ly + 7}" dominant-baseline="central" fill="{ink}">'
        "forward</text>")
    x += 110
    add(f'<rect class="legend-swatch" x="{x}" y="{ly}" width="28" height="14" fill="{mid}" '
        f'stroke="{hex_color(BACKWARD_BORDER)}" stroke-width="2"/>')
    add(f'<rect class="legend-hatch" x="{x}" y="{ly}" width="28" height="14" fill="url(#backward-hatch)"/>')
    add(f'<text class="legend" x="{x + 34}" y="{ly + 7}" dominant-baseline="central" fill="{ink}">'
        "backward</text>")
    x += 120
    add(f'<rect class="legend-swatch" x="{x}" y="{ly}" width="28" height="14" fill="{hex_color(LANE)}"/>')
    add(f'<text class="legend" x="{x + 34}" y="{ly + 7}" dominant-baseline="central" fill="{ink}">'
        "idle (blocked on a neighbour)</text>")
    add("</svg>")
    return "\n".join(out) + "\n"


def _bar_ticks(lay: _Layout) -> list[float]:
    if lay.high_mhz <= lay.low_mhz:
        return [float(lay.low_mhz)]
    ticks = nice_ticks(lay.high_mhz, target=5, low=lay.low_mhz)
    return ticks or [float(lay.low_mhz), float(lay.high_mhz)]


# -- PNG -------------------------------------------------------------------------------------

# A 3x5 bitmap font: five rows of three pixels per glyph. Lower case is drawn as upper case.
_FONT_ROWS: dict[str, str] = {
    "0": "111 101 101 101 111", "1": "010 110 010 010 111", "2": "111 001 111 100 111",
    "3": "111 001 111 001 111", "4": "101 101 111 001 001", "5": "111 100 111 001 111",
    "6": "111 100 111 101 111", "7": "111 001 001 001 001", "8": "111 101 111 101 111",
    "9": "111 101 111 001 111", "A": "010 101 111 101 101", "B": "110 101 110 101 110",
    "C": "011 100 100 100 011", "D": "110 101 101 101 110", "E": "111 100 110 100 111",
    "F": "111 100 110 100 100", "G": "011 100 101 101 011", "H": "101 101 111 101 101",
    "I": "111 010 010 010 111", "J": "001 001 001 101 010", "K": "101 101 110 101 101",
    "L": "100 100 100 100 111", "M": "101 111 111 101 101", "N": "110 101 101 101 101",
    "O": "010 101 101 101 010", "P": "110 101 110 100 100", "Q": "010 101 101 110 011",
    "R": "110 101 110 101 101", "S": "011 100 010 001 110", "T": "111 010 010 010 010",
    "U": "101 101 101 101 111", "V": "101 101 101 101 010", "W": "101 101 111 111 101",
    "X": "101 101 010 101 101", "Y": "101 101 010 010 010", "Z": "111 001 010 100 111",
    " ": "000 000 000 000 000", ".": "000 000 000 000 010", ",": "000 000 000 010 100",
    ":": "000 010 000 010 000", "-": "000 000 111 000 000", "%": "101 001 010 100 101",
    "/": "001 001 010 100 100", "(": "010 100 100 100 010", ")": "010 001 001 001 010",
    "=": "000 111 000 111 000", "+": "000 010 111 010 000", "'": "010 010 000 000 000",
    "?": "111 001 011 000 010",
}
_FONT: dict[str, tuple[tuple[bool, ...], ...]] = {
    ch: tuple(tuple(bit == "1" for bit in row) for row in rows.split()) for ch, rows in _FONT_ROWS.items()
}
_GLYPH_W, _GLYPH_H = 3, 5


def text_width(text: str, scale: int = 2) -> int:
    """Width in pixels of ``text`` drawn by the PNG renderer's bitmap font."""
    return max(0, len(text) * (_GLYPH_W + 1) * scale - scale)


def _draw_text(canvas: np.ndarray, x: int, y: int, text: str, color: Color, scale: int = 2) -> None:
    h, w = canvas.shape[:2]
    for i, ch in enumerate(text.upper()):
        glyph = _FONT.get(ch, _FONT["?"])
        gx = x + i * (_GLYPH_W + 1) * scale
        for r, row in enumerate(glyph):
            for col, on in enumerate(row):
                if on:
                    px, py = gx + col * scale, y + r * scale
                    if px < w and py < h and px + scale > 0 and py + scale > 0:
                        canvas[max(py, 0):py + scale, max(px, 0):px + scale] = color


def _fill(canvas: np.ndarray, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
    h, w = canvas.shape[:2]
    x0, x1 = max(0, x0), min(w, x1)
    y0, y1 = max(0, y0), min(h, y1)
    if x1 > x0 and y1 > y0:
        canvas[y0:y1, x0:x1] = color


def _frame(canvas: np.ndarray, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
    _fill(canvas, x0, y0, x1, y0 + width, color)
    _fill(canvas, x0, y1 - width, x1, y1, color)
    _fill(canvas, x0, y0, x0 + width, y1, color)
    _fill(canvas, x1 - width, y0, x1, y1, color)


def _hatch(canvas: np.ndarray, x0: int, y0: int, x1: int, y1: int, period: int = 7) -> None:
    """Lighten every pixel on diagonal lines ``(x + y) % period == 0`` inside the box."""
    import numpy as np

    if x1 <= x0 or y1 <= y0:
        return
    ys, xs = np.mgrid[y0:y1, x0:x1]
    on = (xs + ys) % period == 0
    region = canvas[y0:y1, x0:x1]
    lightened = region.astype(np.float64) * 0.6 + 255 * 0.4
    region[on] = np.round(lightened[on]).astype(np.uint8)


def encode_png(pixels: np.ndarray) -> bytes:
    """Encode an ``(height, width, 3)`` uint8 RGB array as PNG (8-bit RGB, filter 0 on every row)."""
    import numpy as np

    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"expected an (height, width, 3) array, got shape {pixels.shape}")
    height, width = pixels.shape[:2]
    if height < 1 or width < 1:
        raise ValueError("an image needs at least one pixel")
    rows = np.zeros((height, 1 + 3 * width), dtype=np.uint8)  # column 0: filter type 0 (none)
    rows[:, 1:] = np.ascontiguousarray(pixels, dtype=np.uint8).reshape(height, 3 * width)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
            + chunk(b"IEND", b""))


def box_pixels(dag: PipelineDAG, profile: PipelineProfile, plan: Plan, *, width: int = 1200,
               row_height: int = 36) -> list[tuple[Box, int, int, int, int]]:
    """Where :func:`to_png` draws each computation: ``(box, x0, y0, x1, y1)``, end-exclusive pixels."""
    boxes, lay = _prepare(dag, profile, plan, width, row_height, None)
    return [(b, *_pixel_box(lay, b)) for b in boxes]


def _pixel_box(lay: _Layout, b: Box) -> tuple[int, int, int, int]:
    x0 = int(round(lay.x(b.start_s)))
    x1 = max(x0 + 1, int(round(lay.x(b.end_s))))
    y0 = lay.row_y(b.computation.stage)
    return x0, y0, x1, y0 + lay.row_h


def to_png(
    dag: PipelineDAG,
    profile: PipelineProfile,
    plan: Plan,
    *,
    title: str | None = None,
    width: int = 1200,
    row_height: int = 36,
    frequency_range: tuple[int, int] | None = None,
) -> bytes:
    """The plan's schedule as a PNG image (same layout and colours as :func:`to_svg`).

    Box labels (``F3``, ``B3``) sit in the top-left corner of boxes wide enough for them, so the
    centre of every box shows its frequency's colour (lightened on the hatch lines of backward
    boxes). See :func:`box_pixels` for where each box lands.

    Args:
        dag: The pipeline.
        profile: The profile the plan's frequencies come from (it gives the durations).
        plan: The plan to draw.
        title: Title (default: schedule, shape, iteration time and energy).
        width: Image width, pixels.
        row_height: Height of one stage's row, pixels.
        frequency_range: ``(low, high)`` MHz of the colour bar (default: the profile's range).

    Raises:
        PipelineProfileError: The profile does not cover the pipeline.
        PlanError: The plan does not fit the pipeline or the profile.
        ValueError: ``width`` or ``row_height`` too small.
    """
    import numpy as np

    boxes, lay = _prepare(dag, profile, plan, width, row_height, frequency_range)
    title = default_title(dag, plan, lay.time_s) if title is None else title
    canvas = np.full((lay.height, lay.width, 3), 255, dtype=np.uint8)
    _draw_text(canvas, lay.left, 12, title, INK)

    for s in range(dag.stages):
        y = lay.row_y(s)
        _fill(canvas, lay.left, y, lay.right, y + lay.row_h, LANE)
        label = f"GPU {s}"
        _draw_text(canvas, lay.left - 8 - text_width(label), y + (lay.row_h - 10) // 2, label, INK)

    for b in boxes:
        x0, y0, x1, y1 = _pixel_box(lay, b)
        fill = frequency_color(b.frequency, lay.low_mhz, lay.high_mhz)
        _fill(canvas, x0, y0, x1, y1, fill)
        if b.computation.kind == "backward":
            border = 2 if x1 - x0 >= 8 else 1
            _hatch(canvas, x0 + border, y0 + border, x1 - border, y1 - border)
            if x1 - x0 >= 3:
                _frame(canvas, x0, y0, x1, y1, BACKWARD_BORDER, border)
        elif x1 - x0 >= 4:
            _frame(canvas, x0, y0, x1, y1, _shade(fill, 0.55))
        name = b.computation.name
        if _label_fits(name, x1 - x0, 8.0, lay.row_h, 30):
            _draw_text(canvas, x0 + 4, y0 + 4, name, _text_color(fill))

    # Time axis.
    _fill(canvas, lay.left, lay.axis_y, lay.right + 1, lay.axis_y + 1, INK)
    for t_ms in nice_ticks(lay.time_s * 1e3):
        x = int(round(lay.x(t_ms / 1e3)))
        _fill(canvas, x, lay.axis_y, x + 1, lay.axis_y + 6, INK)
        label = _tick_label(t_ms)
        _draw_text(canvas, x - text_width(label) // 2, lay.axis_y + 10, label, INK)
    axis_label = "TIME (MS)"
    _draw_text(canvas, (lay.left + lay.right - text_width(axis_label)) // 2, lay.axis_y + 26, axis_label, INK)

    # Colour bar: top is the highest frequency.
    span = max(1, lay.bar_y1 - lay.bar_y0 - 1)
    for y in range(lay.bar_y0, lay.bar_y1):
        _fill(canvas, lay.bar_x, y, lay.bar_x + lay.bar_w, y + 1, ramp((lay.bar_y1 - 1 - y) / span))
    _frame(canvas, lay.bar_x - 1, lay.bar_y0 - 1, lay.bar_x + lay.bar_w + 1, lay.bar_y1 + 1, INK)
    _draw_text(canvas, lay.bar_x, lay.bar_y0 - 16, "MHZ", INK)
    for mhz in _bar_ticks(lay):
        y = int(round(lay.bar_y(mhz)))
        _fill(canvas, lay.bar_x + lay.bar_w, y, lay.bar_x + lay.bar_w + 4, y + 1, INK)
        _draw_text(canvas, lay.bar_x + lay.bar_w + 7, y - 5, _tick_label(mhz), INK)

    # Legend.
    mid = ramp(0.5)
    ly, x = lay.legend_y, lay.left
    _fill(canvas, x, ly, x + 28, ly + 14, mid)
    _frame(canvas, x, ly, x + 28, ly + 14, _shade(mid, 0.55))
    _draw_text(canvas, x + 34, ly + 2, "FORWARD", INK)
    x += 110
    _fill(canvas, x, ly, x + 28, ly + 14, mid)
    _hatch(canvas, x + 2, ly + 2, x + 26, ly + 12)
    _frame(canvas, x, ly, x + 28, ly + 14, BACKWARD_BORDER, 2)
    _draw_text(canvas, x + 34, ly + 2, "BACKWARD", INK)
    x += 120
    _fill(canvas, x, ly, x + 28, ly + 14, LANE)
    _draw_text(canvas, x + 34, ly + 2, "IDLE (BLOCKED)", INK)
    return encode_png(canvas)


# -- files -----------------------------------------------------------------------------------

def save_picture(
    path: str | Path, dag: PipelineDAG, profile: PipelineProfile, plan: Plan, **options: object
) -> Path:
    """Write the picture of ``plan`` to ``path``: SVG or PNG by its suffix.

    Args:
        path: A ``.svg`` or ``.png`` file (parent directories are created).
        dag: The pipeline.
        profile: The profile the plan's frequencies come from.
        plan: The plan to draw.
        **options: Passed to :func:`to_svg` or :func:`to_png` (``title``, ``width``, ...).

    Returns:
        ``path``.

    Raises:
        PlanError: Another suffix, or the plan does not fit the pipeline or the profile.
        PipelineProfileError: The profile does not cover the pipeline.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise PlanError(f"cannot draw a picture as {path.name!r}: use a .svg or .png file name")
    if suffix == ".svg":
        data: bytes = to_svg(dag, profile, plan, **options).encode()  # type: ignore[arg-type]
    else:
        data = to_png(dag, profile, plan, **options)  # type: ignore[arg-type]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
