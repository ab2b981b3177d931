"""Pictures of pipeline frequency plans: SVG and PNG, checked element by element and pixel by pixel."""

from __future__ import annotations

import struct
import xml.etree.ElementTree as ET
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from joules.optimizers.pipeline.frontier import Plan, PlanError, evaluate
from joules.optimizers.pipeline.picture import (
    RAMP,
    box_pixels,
    encode_png,
    frequency_color,
    hex_color,
    nice_ticks,
    ramp,
    save_picture,
    schedule_boxes,
    to_png,
    to_svg,
)
from joules.optimizers.pipeline.profile import PipelineProfileError, synthetic_profile
from joules.optimizers.pipeline.schedule import PipelineDAG, build_dag

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def setup() -> tuple[PipelineDAG, object, Plan]:
    profile = synthetic_profile(3, "a100", seed=1)
    dag = build_dag("1f1b", 3, 4)
    freqs = profile.frequencies()
    # Mixed frequencies: lowest, highest and one in the middle, in turn.
    choice = [freqs[0], freqs[-1], freqs[len(freqs) // 2]]
    plan = evaluate(dag, profile, [choice[i % 3] for i in range(len(dag.nodes))], 85.0)
    return dag, profile, plan


def decode_png(data: bytes) -> np.ndarray:
    """A minimal decoder for what the encoder writes: 8-bit RGB, filter 0 rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    kinds = []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        kinds.append(kind)
        if kind == b"IHDR":
            w, h, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert (depth, color_type, interlace) == (8, 2, 0)
            size = (w, h)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and size is not None
    w, h = size
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all(), "every row uses filter type 0"
    return raw[:, 1:].reshape(h, w, 3)


def test_ramp_runs_from_dark_purple_to_yellow_and_frequency_maps_onto_it() -> None:
    assert ramp(0.0) == RAMP[0] and ramp(1.0) == RAMP[-1]
    assert ramp(-3) == RAMP[0] and ramp(7) == RAMP[-1]
    assert ramp(0.5) == RAMP[4]
    lum = [0.2126 * r + 0.7152 * g + 0.0722 * b for r, g, b in (ramp(i / 20) for i in range(21))]
    assert all(a < b for a, b in zip(lum, lum[1:], strict=False)), "perceptual ramp: brightness rises"
    assert frequency_color(900, 900, 1410) == RAMP[0]
    assert frequency_color(1410, 900, 1410) == RAMP[-1]
    assert frequency_color(1000, 1000, 1000) == RAMP[-1]  # one frequency only
    assert hex_color((255, 0, 16)) == "#ff0010"


def test_nice_ticks() -> None:
    assert nice_ticks(100.0, target=5) == [0, 20, 40, 60, 80, 100]
    tiny = nice_ticks(4e-297)  # returned at once (an absolute tolerance once made this loop ~forever)
    assert 3 <= len(tiny) <= 34 and tiny[0] == 0 and tiny[-1] <= 4e-297 * (1 + 1e-6)
    assert nice_ticks(1322.6) == [0, 200, 400, 600, 800, 1000, 1200]
    assert nice_ticks(1410, target=5, low=900) == [1000, 1200, 1400]
    assert nice_ticks(1410, target=10, low=900) == [900, 1000, 1100, 1200, 1300, 1400]
    assert nice_ticks(0.0) == [0.0]


def test_boxes_follow_the_timeline(setup) -> None:
    dag, profile, plan = setup
    boxes = schedule_boxes(dag, profile, plan)
    table = {(c.stage, c.kind): {o.frequency: o for o in profile.of(c.stage, c.kind)} for c in dag.nodes}
    for b, c, f in zip(boxes, dag.nodes, plan.frequencies, strict=True):
        assert b.end_s - b.start_s == pytest.approx(table[(c.stage, c.kind)][f].time_s)  # the profiled time
    # Each box starts as soon as everything it depends on has ended.
    for v, b in enumerate(boxes):
        assert b.start_s == pytest.approx(max((boxes[u].end_s for u, w in dag.edges if w == v), default=0.0))
    assert max(b.end_s for b in boxes) == pytest.approx(plan.time_s)
    # A stage never runs two computations at once.
    for order in dag.stage_order:
        for a, b in zip(order, order[1:], strict=False):
            assert boxes[a].end_s <= boxes[b].start_s + 1e-12


def test_svg_has_one_rect_per_computation_placed_on_the_time_scale(setup) -> None:
    dag, profile, plan = setup
    root = ET.fromstring(to_svg(dag, profile, plan, width=900))
    assert root.tag == f"{SVG}svg" and root.get("width") == "900"
    rects = [r for r in root.iter(f"{SVG}rect") if "computation" in (r.get("class") or "").split()]
    assert len(rects) == len(dag.nodes)
    lanes = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "lane"]
    assert len(lanes) == dag.stages
    left, plot_w = float(lanes[0].get("x")), float(lanes[0].get("width"))
    scale = plot_w / plan.time_s
    boxes = schedule_boxes(dag, profile, plan)
    lo, hi = min(profile.frequencies()), max(profile.frequencies())
    for r in rects:
        b = boxes[int(r.get("data-node"))]
        c = b.computation
        assert r.get("class").split() == ["computation", c.kind]
        assert int(r.get("data-stage")) == c.stage and int(r.get("data-microbatch")) == c.microbatch
        assert int(r.get("data-frequency")) == b.frequency
        assert float(r.get("x")) == pytest.approx(left + b.start_s * scale, abs=2e-3)
        assert float(r.get("width")) == pytest.approx(b.duration_s * scale, abs=2e-3)
        assert float(r.get("y")) == float(lanes[c.stage].get("y"))
        assert float(r.get("data-start-ms")) == pytest.approx(b.start_s * 1e3)
        assert r.get("fill") == hex_color(frequency_color(b.frequency, lo, hi))
        assert r.find(f"{SVG}title") is not None
    # Backward is told apart: its own hatch overlay and a thicker border; boxes are labelled.
    hatches = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "hatch"]
    assert len(hatches) == sum(c.kind == "backward" for c in dag.nodes)
    widths = {r.get("class").split()[1]: r.get("stroke-width") for r in rects}
    assert widths == {"forward": "1", "backward": "2"}
    labels = {t.text for t in root.iter(f"{SVG}text") if t.get("class") == "label"}
    assert {"F0", "B3"} <= labels
    # Axis in ms up to the iteration time, colour bar in MHz, title with time and energy.
    ticks = [float(t.text) for t in root.iter(f"{SVG}text") if t.get("class") == "tick-label"]
    assert ticks[0] == 0 and ticks[-1] <= plan.time_s * 1e3 < ticks[-1] + (ticks[1] - ticks[0])
    assert any(t.text == "MHz" for t in root.iter(f"{SVG}text"))
    bar_labels = [float(t.text) for t in root.iter(f"{SVG}text") if t.get("class") == "colorbar-tick-label"]
    assert bar_labels and lo <= min(bar_labels) and max(bar_labels) <= hi
    title = next(t.text for t in root.iter(f"{SVG}text") if t.get("class") == "title")
    assert f"{plan.time_s * 1e3:,.1f} ms" in title and f"{plan.energy_j:,.0f} J" in title


def test_svg_escapes_the_title(setup) -> None:
    dag, profile, plan = setup
    root = ET.fromstring(to_svg(dag, profile, plan, title="a < b & c"))
    assert next(t.text for t in root.iter(f"{SVG}text") if t.get("class") == "title") == "a < b & c"
    # Control characters (an ANSI escape pasted in) have no place in XML 1.0: replaced.
    root = ET.fromstring(to_svg(dag, profile, plan, title="run\x1b[1m 42\x0c"))
    title = next(t.text for t in root.iter(f"{SVG}text") if t.get("class") == "title")
    assert title == "run\ufffd[1m 42\ufffd"


def test_png_decodes_and_boxes_show_their_frequency_colour(setup) -> None:
    dag, profile, plan = setup
    img = decode_png(to_png(dag, profile, plan, width=1000, row_height=40))
    assert img.shape[1] == 1000 and img.shape[0] > dag.stages * 40
    lo, hi = min(profile.frequencies()), max(profile.frequencies())
    seen_hatch = False
    for b, x0, y0, x1, y1 in box_pixels(dag, profile, plan, width=1000, row_height=40):
        color = frequency_color(b.frequency, lo, hi)
        centre = tuple(int(v) for v in img[(y0 + y1) // 2, (x0 + x1) // 2])
        if b.computation.kind == "forward":
            assert centre == color, b
            assert tuple(img[y0, x0]) != color  # the border
        else:
            inner = img[y0 + 2:y1 - 2, x0 + 2:x1 - 2].reshape(-1, 3)
            counts = Counter(tuple(int(v) for v in px) for px in inner)
            assert counts.most_common(1)[0][0] == color, b
            seen_hatch |= len(counts) > 1
            assert tuple(int(v) for v in img[y0, x0]) == (20, 20, 20)  # dark border
    assert seen_hatch, "backward boxes are hatched"
    # The colour bar runs from the highest frequency's colour (top) to the lowest (bottom).
    bar = [tuple(int(v) for v in px) for px in img[:, 1000 - 110 + 34 + 8]]
    assert RAMP[-1] in bar and RAMP[0] in bar
    assert bar.index(RAMP[-1]) < bar.index(RAMP[0])


def test_png_encoder_round_trips() -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(7, 5, 3), dtype=np.uint8)
    assert (decode_png(encode_png(pixels)) == pixels).all()
    with pytest.raises(ValueError):
        encode_png(np.zeros((4, 4), dtype=np.uint8))


def test_save_picture_by_suffix(setup, tmp_path: Path) -> None:
    dag, profile, plan = setup
    svg = save_picture(tmp_path / "a" / "plan.svg", dag, profile, plan)
    ET.parse(svg)
    png = save_picture(tmp_path / "plan.PNG", dag, profile, plan, width=600)
    assert decode_png(png.read_bytes()).shape[1] == 600
    with pytest.raises(PlanError, match=r"\.svg or \.png"):
        save_picture(tmp_path / "plan.pdf", dag, profile, plan)
    assert not (tmp_path / "plan.pdf").exists()


def test_plans_that_do_not_fit_are_refused(setup) -> None:
    dag, profile, plan = setup
    with pytest.raises(PlanError, match="frequencies"):
        to_svg(dag, profile, Plan(plan.frequencies[:-1], plan.time_s, plan.energy_j))
    with pytest.raises(PlanError, match="no 1234 MHz"):
        to_png(dag, profile, Plan((1234,) + plan.frequencies[1:], plan.time_s, plan.energy_j))
    with pytest.raises(PipelineProfileError, match="stage 3"):
        to_svg(build_dag("gpipe", 4, 2), profile, Plan((1410,) * 16, 1.0, 1.0))
    with pytest.raises(ValueError, match="too small"):
        to_png(dag, profile, plan, width=100)


def test_gpipe_with_one_frequency_and_narrow_boxes(tmp_path: Path) -> None:
    profile = synthetic_profile(4, "h100", lowest_mhz=1980)  # a single clock
    dag = build_dag("gpipe", 4, 32)
    plan = evaluate(dag, profile, [1980] * len(dag.nodes), 110.0)
    root = ET.fromstring(to_svg(dag, profile, plan))
    assert {r.get("fill") for r in root.iter(f"{SVG}rect") if "computation" in (r.get("class") or "")} == {
        hex_color(RAMP[-1])}
    img = decode_png(to_png(dag, profile, plan))
    assert img.shape[1] == 1200
