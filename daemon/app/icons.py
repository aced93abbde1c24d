"""The status app's icons: the mesh glyph with a badge per state, for light and dark bars.

Drawn with Pillow at four times the asked size and scaled down (smooth edges at the 16-32
pixels a tray or menu bar shows). The glyph is three linked nodes in the bar's foreground
colour; the badge at its lower right carries the state:

| state       | badge                                   |
|-------------|-----------------------------------------|
| serving     | green disc                              |
| re-planning | blue disc with a turning arrow          |
| converging  | amber disc with three dots              |
| refused     | red disc with a bar (no entry)          |
| no model    | an empty ring                           |
| daemon down | grey disc with a cross, glyph faded     |

`light` icons are for light bars (dark glyph), `dark` ones for dark bars (light glyph).
"""

from __future__ import annotations

import functools
import math

from PIL import Image, ImageDraw

from meshd.app.status_model import MeshState

THEMES = ("light", "dark")
CANVAS = 256  # drawing size before scaling down; coordinates below are on this canvas

FOREGROUND = {"light": (31, 35, 40, 255), "dark": (240, 243, 246, 255)}
BADGE_COLOURS: dict[MeshState, tuple[int, int, int, int]] = {
    MeshState.READY: (46, 160, 67, 255),
    MeshState.UPDATING: (31, 111, 235, 255),
    MeshState.CONVERGING: (210, 153, 34, 255),
    MeshState.REFUSED: (207, 34, 46, 255),
    MeshState.UNREACHABLE: (110, 118, 129, 255),
}
WHITE = (255, 255, 255, 255)
CLEAR = (0, 0, 0, 0)

# A margin of 1/16 on every side: trays clip an icon that fills its slot exactly.
NODES = ((100, 46), (42, 158), (164, 158))  # the glyph: three nodes ...
NODE_RADIUS = 27
LINK_WIDTH = 16  # ... and the links between them
BADGE_CENTRE = (190, 190)
BADGE_RADIUS = 50
BADGE_GAP = 14  # transparent ring between the glyph and the badge
FADED_ALPHA = 0.4  # the glyph's opacity while the daemon is down


@functools.lru_cache(maxsize=64)
def icon_image(state: MeshState, theme: str = "light", size: int = 64) -> Image.Image:
    """The icon of `state` for a `theme` bar, `size` pixels square (RGBA).

    Cached: callers must not draw on the returned image.
    """
    if theme not in THEMES:
        raise ValueError(f"theme must be one of {', '.join(THEMES)}, not {theme!r}")
    foreground = FOREGROUND[theme]
    canvas = Image.new("RGBA", (CANVAS, CANVAS), CLEAR)
    draw = ImageDraw.Draw(canvas)
    _draw_glyph(draw, foreground)
    _circle(draw, BADGE_CENTRE, BADGE_RADIUS + BADGE_GAP, fill=CLEAR)  # cut the badge's place
    if state is MeshState.UNREACHABLE:
        alpha = canvas.getchannel("A").point(lambda a: int(a * FADED_ALPHA))
        canvas.putalpha(alpha)
    _draw_badge(ImageDraw.Draw(canvas), state, foreground)
    return canvas.resize((size, size), Image.Resampling.LANCZOS)


def all_icons(theme: str, size: int = 64) -> dict[MeshState, Image.Image]:
    return {state: icon_image(state, theme, size) for state in MeshState}


def _circle(draw: ImageDraw.ImageDraw, centre: tuple[int, int], radius: float, **style) -> None:
    x, y = centre
    draw.ellipse((x - radius, y - radius, x + radius, y + radius), **style)


def _draw_glyph(draw: ImageDraw.ImageDraw, colour: tuple[int, int, int, int]) -> None:
    for i, start in enumerate(NODES):
        for end in NODES[i + 1 :]:
            draw.line((start, end), fill=colour, width=LINK_WIDTH)
    for node in NODES:
        _circle(draw, node, NODE_RADIUS, fill=colour)


def _draw_badge(
    draw: ImageDraw.ImageDraw, state: MeshState, foreground: tuple[int, int, int, int]
) -> None:
    cx, cy = BADGE_CENTRE
    r = BADGE_RADIUS
    if state is MeshState.NO_MODEL:
        _circle(draw, BADGE_CENTRE, r - 6, outline=foreground, width=16)
        return
    _circle(draw, BADGE_CENTRE, r, fill=BADGE_COLOURS[state])
    mark = 12  # stroke width of the white marks
    if state is MeshState.UPDATING:
        box = (cx - r * 0.55, cy - r * 0.55, cx + r * 0.55, cy + r * 0.55)
        draw.arc(box, start=-60, end=210, fill=WHITE, width=mark)
        angle = math.radians(-60)  # arrowhead at the arc's open end
        tip_x, tip_y = cx + r * 0.55 * math.cos(angle), cy + r * 0.55 * math.sin(angle)
        head = r * 0.32
        draw.polygon(
            [
                (tip_x - head, tip_y - head * 0.2),
                (tip_x + head * 0.6, tip_y - head),
                (tip_x + head * 0.3, tip_y + head * 0.6),
            ],
            fill=WHITE,
        )
    elif state is MeshState.CONVERGING:
        for dx in (-0.5, 0.0, 0.5):
            _circle(draw, (round(cx + dx * r), cy), r * 0.14, fill=WHITE)
    elif state is MeshState.REFUSED:
        half = r * 0.55
        draw.rectangle((cx - half, cy - mark, cx + half, cy + mark), fill=WHITE)
    elif state is MeshState.UNREACHABLE:
        half = r * 0.4
        draw.line((cx - half, cy - half, cx + half, cy + half), fill=WHITE, width=mark + 2)
        draw.line((cx - half, cy + half, cx + half, cy - half), fill=WHITE, width=mark + 2)


def contact_sheet(size: int = 64, padding: int = 12) -> Image.Image:
    """Every icon on both bars, one row per theme (for docs/operations.md and visual checks)."""
    states = list(MeshState)
    width = padding + len(states) * (size + padding)
    height = padding + len(THEMES) * (size + padding)
    sheet = Image.new("RGBA", (width, height), (0, 0, 0, 0))
    bars = {"light": (236, 236, 236, 255), "dark": (36, 36, 40, 255)}
    for row, theme in enumerate(THEMES):
        top = padding // 2 + row * (size + padding)
        sheet.paste(bars[theme], (0, top, width, top + size + padding))
        for col, state in enumerate(states):
            icon = icon_image(state, theme, size)
            sheet.alpha_composite(icon, (padding + col * (size + padding), top + padding // 2))
    return sheet
