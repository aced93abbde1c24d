"""What users see of a mesh downloading a Hub repository: `meshd status`, the bar per node of
`meshd load`, the tray's line, and `meshd models` for a repository held in part.

Real MeshStatus messages (as the daemon assembles them from the gossiped downloads) through
the real renderers; the daemon side is exercised end to end in tests/test_hub_load.py.
"""

from __future__ import annotations

import pytest

from meshd.api import render
from meshd.api.hub_cli import _bar
from meshd.app.status_model import menu_from_status
from meshd.wire import pb

pytestmark = pytest.mark.unit

REPO = "org/model@0123456789ab"


def _downloading() -> pb.MeshStatus:
    downloads = [
        pb.Download(
            node="n1",
            repo=REPO,
            file="a.safetensors",
            done_bytes=50_000_000,
            total_bytes=100_000_000,
            rate_bytes_per_s=10_000_000,
            seconds_left=5,
            source="hub",
        ),
        pb.Download(
            node="n1",
            repo=REPO,
            file="b.safetensors",
            done_bytes=0,
            total_bytes=100_000_000,
            rate_bytes_per_s=0,
            seconds_left=0,
            source="peer n2",
        ),
        pb.Download(
            node="n2",
            repo=REPO,
            file="c.safetensors",
            done_bytes=100_000_000,
            total_bytes=100_000_000,
            rate_bytes_per_s=20_000_000,
            seconds_left=0,
            source="hub",
        ),
    ]
    return pb.MeshStatus(
        node_id="n1",
        agreement=pb.AgreementStatus(model="org/model", active_plan_id="p" * 16),
        transitions=pb.PlanTransitions(active_plan_loaded=False, moving="loading plan p"),
        downloads=downloads,
    )


def test_downloads_are_summed_per_node_with_their_sources() -> None:
    n1, n2 = render.downloads_by_node(_downloading().downloads)
    assert (n1.node, n1.files, n1.done_bytes, n1.total_bytes) == ("n1", 2, 50_000_000, 200_000_000)
    assert n1.sources == ("hub", "peer n2") and n1.seconds_left == 5
    assert n1.fraction == 0.25 and n2.fraction == 1.0
    bar = _bar(n1)
    assert bar.startswith("[" + "#" * 6 + "." * 18 + "] n1: 25% of ")
    assert "2 file(s)" in bar and "5 s left" in bar and "(hub, peer n2)" in bar


def test_status_text_lists_each_file_and_its_source() -> None:
    text = render.status_text(_downloading())
    assert "downloading:" in text
    assert "n1  b.safetensors" in text and "from peer n2" in text


def test_the_tray_shows_one_line_for_the_mesh_download() -> None:
    items = menu_from_status(_downloading()).items
    lines = [item for item in items if item.startswith("downloading")]
    assert len(lines) == 1 and "50% of" in lines[0] and "2 node(s)" in lines[0], items


def test_models_table_says_what_a_node_holds_of_a_cached_repository() -> None:
    models = pb.ModelList(
        models=[
            pb.ModelInfo(
                name="org/model",
                architecture="llama",
                size_bytes=1_000_000_000,
                total_bytes=4_000_000_000,
                partial=True,
                source="hf-cache",
                revision="0123456789abcdef",
            )
        ]
    )
    table = render.models_table(models)
    assert "of" in table and "(partial)" in table and "hf-cache @0123456789ab" in table
