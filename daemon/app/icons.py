"""The status app's icons: the mesh glyph with a badge per state, for light and dark bars.

Drawn with Pillow at four times the asked size and scaled down (smooth edges at the 16-32
pixels a tray or menu bar shows). The glyph is three linked nodes in the bar's foreground
colour; the badge at its lower right carries the state:

| state       | badge                                   |
|-------------|-----------------------------------------|
| serving     | green disc                              |
| loading     | teal disc with a quarter-filled clock   |
| re-planning | blue disc with a turning arrow          |
| converging  | amber disc with three dots              |
| refused     | red disc with a bar (no entry)          |
| no model    | an empty ring                           |
| daemon down | grey disc with a cross, glyph faded     |

`light` icons are for light bars (dark glyph), `dark` ones for dark bars (light glyph), and
`any` ones (a mid-grey glyph) for a bar whose colour the desktop does not tell: each reads at
a contrast of at least 3:1 (WCAG) on its bars. The badges' colours are mid-tones that read
at 3:1 on light and dark bars alike, so a state is legible whichever icons are drawn.
"""

from __future__ import annotations

import functools
import math

from PIL import Image, ImageDraw

from meshd.app.status_model import MeshState

THEMES = ("light", "dark", "any")
CANVAS = 256  # drawing size before scaling down; coordinates below are on this canvas

FOREGROUND = {
    "light": (31, 35, 40, 255),
    "dark": (240, 243, 246, 255),
    "any": (118, 118, 124, 255),  # relative luminance 0.18: 4.0:1 on #f0f0f0, 3.6:1 on #202020
}
# Relative luminance 0.15-0.23 each: at least 3.2:1 on #f0f0f0 and on #202020.
BADGE_COLOURS: dict[MeshState, tuple[int, int, int, int]] = {
    MeshState.READY: (30, 140, 60, 255),
    MeshState.LOADING: (0, 128, 150, 255),
    MeshState.UPDATING: (31, 111, 235, 255),
    MeshState.CONVERGING: (176, 120, 0, 255),
    MeshState.REFUSED: (226, 56, 62, 255),
    MeshState.UNREACHABLE: (110, 118, 129, 255),
}
# A light bar's badges a shade darker, a dark bar's a shade lighter: the white marks inside
# take a larger share of a small icon, and the disc around them must carry the contrast.
BADGE_SHADE = {"light": -0.3, "dark": 0.15, "any": -0.08}
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
    _draw_badge(ImageDraw.Draw(canvas), state, foreground, BADGE_SHADE[theme])
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


def _shaded(colour: tuple[int, int, int, int], shade: float) -> tuple[int, int, int, int]:
    """`colour` mixed with black (shade < 0) or white (shade > 0) by |shade|."""
    target = 255 if shade > 0 else 0
    r, g, b, a = colour
    return (*(round(c + (target - c) * abs(shade)) for c in (r, g, b)), a)


def _draw_badge(
    draw: ImageDraw.ImageDraw,
    state: MeshState,
    foreground: tuple[int, int, int, int],
    shade: float,
) -> None:
    cx, cy = BADGE_CENTRE
    r = BADGE_RADIUS
    if state is MeshState.NO_MODEL:
        _circle(draw, BADGE_CENTRE, r - 6, outline=foreground, width=16)
        return
    _circle(draw, BADGE_CENTRE, r, fill=_shaded(BADGE_COLOURS[state], shade))
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
    elif state is MeshState.LOADING:
        inner = r * 0.58
        box = (cx - inner, cy - inner, cx + inner, cy + inner)
        draw.ellipse(box, outline=WHITE, width=mark - 2)
        draw.pieslice(box, start=-90, end=0, fill=WHITE)
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


LIGHT_PANEL = (240, 240, 240, 255)
DARK_PANEL = (32, 32, 32, 255)
PANELS = {"light": (LIGHT_PANEL,), "dark": (DARK_PANEL,), "any": (LIGHT_PANEL, DARK_PANEL)}


def contact_sheet(size: int = 64, padding: int = 12) -> Image.Image:
    """Every icon on the bars it is drawn for, one row per theme and bar (visual checks)."""
    states = list(MeshState)
    rows = [(theme, panel) for theme in THEMES for panel in PANELS[theme]]
    width = padding + len(states) * (size + padding)
    height = padding + len(rows) * (size + padding)
    sheet = Image.new("RGBA", (width, height), (0, 0, 0, 0))
    for row, (theme, panel) in enumerate(rows):
        top = padding // 2 + row * (size + padding)
        sheet.paste(panel, (0, top, width, top + size + padding))
        for col, state in enumerate(states):
            icon = icon_image(state, theme, size)
            sheet.alpha_composite(icon, (padding + col * (size + padding), top + padding // 2))
    return sheet
