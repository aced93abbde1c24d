"""The status app's core: a mesh status in a few short lines, and a feed that follows the daemon.

Every front end (the tray, the macOS menu bar, the terminal) only draws a `Menu`; everything worth
testing lives here, with no GUI import, so it runs on any machine. A `Menu` is rebuilt from
each `MeshStatus` the daemon streams over its local API (`Local.WatchStatus`), and
`StatusFeed` keeps that stream open in a background thread: it reconnects with a bounded
backoff when the daemon stops or restarts, and says "unreachable" in the meantime.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from meshd.wire import pb, rpc
from partitioner.humanize import format_bytes, format_flops

log = logging.getLogger("meshd.status_app")

SEPARATOR = ""  # an empty item: front ends draw a separator line there
MAX_ITEM_CHARS = 100  # a menu line longer than this is cut with an ellipsis
MAX_TITLE_MODEL_CHARS = 18  # the model name in the menu-bar title is cut to this
RECENT_EVENTS = 3
MAX_REASONS = 3
NO_MODEL_REASON = "no model selected"


class MeshState(enum.Enum):
    """What the title says at a glance, from best to worst."""

    READY = "ready"  # a committed plan whose stages are loaded here, nothing pending: serving
    LOADING = "loading"  # a committed plan whose stages this node is still loading
    UPDATING = "updating"  # serving a committed plan while agreeing on a new one
    CONVERGING = "converging"  # no committed plan yet, agreement under way
    REFUSED = "refused"  # the model does not fit this mesh (or cannot be planned)
    NO_MODEL = "no model"  # the mesh runs, nobody selected a model
    UNREACHABLE = "unreachable"  # no daemon answers on the API address


TITLE_MARKS: dict[MeshState, str] = {
    MeshState.READY: "◉",
    MeshState.LOADING: "◔",
    MeshState.UPDATING: "◐",
    MeshState.CONVERGING: "◌",
    MeshState.REFUSED: "⊘",
    MeshState.NO_MODEL: "○",
    MeshState.UNREACHABLE: "✕",
}


@dataclass(frozen=True)
class Menu:
    """What a front end shows: a short menu-bar title and the lines of the drop-down.

    `items` are single lines; an empty string (SEPARATOR) separates sections. `model` is
    the model the mesh runs ("" when none or unknown); `dashboard_url` is where the daemon
    serves its dashboard ("" while it serves none).
    """

    title: str
    items: tuple[str, ...]
    state: MeshState
    model: str = ""
    dashboard_url: str = ""


# ---------------------------------------------------------------- status -> menu


def menu_from_status(status: pb.MeshStatus) -> Menu:
    """The menu for one status: title, mesh line, plan lines, node lines, recent events."""
    state = mesh_state(status.agreement, status.transitions)
    alive = sum(1 for node in status.nodes if node.alive)
    plan = _parse_plan(status.agreement.plan_json)
    sections = [
        [_mesh_line(status)],
        [*_agreement_lines(status.agreement, state, plan), *_loading_lines(status, state)],
        [_node_line(node, _layers_by_node(plan)) for node in status.nodes],
        _memory_lines(status.memory),
        [f"recent: {line}" for line in status.events[-RECENT_EVENTS:]],
    ]
    items: list[str] = []
    for section in sections:
        if section:
            items += [SEPARATOR] if items else []
            items += [_one_line(line) for line in section]
    return Menu(
        title=_title(state, alive, status.agreement.model),
        items=tuple(items),
        state=state,
        model=status.agreement.model,
        dashboard_url=dashboard_url(status),
    )


def dashboard_url(status: pb.MeshStatus) -> str:
    """The daemon's dashboard URL ("" from a daemon that reports none, or predates the field).

    Daemons with HTTP report the base URL of their APIs and dashboard in `http_url`; older
    ones have no such field, and the app shows the status text instead.
    """
    return str(getattr(status, "http_url", "") or "")


def menu_unreachable(error_text: str) -> Menu:
    """The menu while no daemon answers: say so, why (an item per error line), what to do."""
    lines = [
        "meshd is not reachable",
        *(error_text.strip().splitlines() or ["no answer from the daemon"]),
        "start it with `meshd service start` or `meshd run`; retrying",
    ]
    return Menu(
        title=f"{TITLE_MARKS[MeshState.UNREACHABLE]} meshd",
        items=tuple(_one_line(line) for line in lines),
        state=MeshState.UNREACHABLE,
    )


def mesh_state(
    view: pb.AgreementStatus, transitions: pb.PlanTransitions | None = None
) -> MeshState:
    """Classify the agreement view; a refusal outranks a still-served older plan.

    A committed plan serves only once this node's stages of it are loaded (seconds after the
    commit, longer for a large model): until `transitions` says so, the state is LOADING. A
    daemon that predates `active_plan_loaded` leaves it unset, and is taken at its plan.
    """
    if not view.model:
        return MeshState.NO_MODEL
    if view.refusal:
        return MeshState.REFUSED
    if not view.active_plan_id:
        return MeshState.CONVERGING
    if _still_loading(transitions):
        return MeshState.LOADING
    return MeshState.READY if view.converged else MeshState.UPDATING


def _still_loading(transitions: pb.PlanTransitions | None) -> bool:
    if transitions is None or not transitions.HasField("active_plan_loaded"):
        return False
    return not transitions.active_plan_loaded


def _title(state: MeshState, alive: int, model: str) -> str:
    mark = TITLE_MARKS[state]
    words = {
        MeshState.READY: _shorten(model, MAX_TITLE_MODEL_CHARS),
        MeshState.LOADING: "loading",
        MeshState.UPDATING: "re-planning",
        MeshState.CONVERGING: "converging",
        MeshState.REFUSED: "refused",
        MeshState.NO_MODEL: "no model",
    }[state]
    return f"{mark} {alive} · {words}"


def _mesh_line(status: pb.MeshStatus) -> str:
    alive = sum(1 for node in status.nodes if node.alive)
    lost = len(status.nodes) - alive
    line = f"mesh {status.mesh_name} · {alive} {'node' if alive == 1 else 'nodes'} alive"
    return line + (f" · {lost} lost" if lost else "")


def _agreement_lines(
    view: pb.AgreementStatus, state: MeshState, plan: dict[str, Any] | None
) -> list[str]:
    if state is MeshState.NO_MODEL:
        return ["no model selected · choose one with `meshd load MODEL`"]
    lines = [f"model {view.model}"]
    if view.active_plan_id:
        lines.append(_plan_line(view, plan))
    if view.refusal:
        lines.append(f"refused: {view.refusal.strip().splitlines()[0]}")
    lines += [f"converging: {reason}" for reason in _pending_reasons(view)]
    if view.draining:
        lines.append("draining: " + ", ".join(plan_id[:8] for plan_id in view.draining))
    return lines


def _loading_lines(status: pb.MeshStatus, state: MeshState) -> list[str]:
    """What this node is loading while the committed plan waits for its stages."""
    if state is not MeshState.LOADING:
        return []
    moving = status.transitions.moving.strip()
    return [moving or "loading this node's stages of the plan", *_download_lines(status)]


def _download_lines(status: pb.MeshStatus) -> list[str]:
    """One line for the whole mesh while it downloads a Hub repository: how far, how fast,
    how long yet, over how many nodes."""
    if not status.downloads:
        return []
    done = sum(item.done_bytes for item in status.downloads)
    total = sum(item.total_bytes for item in status.downloads)
    rate = sum(item.rate_bytes_per_s for item in status.downloads)
    left = max(item.seconds_left for item in status.downloads)
    nodes = len({item.node for item in status.downloads})
    share = f"{100 * done // total}%" if total else "0%"
    tail = f", {left:.0f} s left" if left else ""
    return [
        f"downloading {share} of {format_bytes(total)} on {nodes} node(s), "
        f"{format_bytes(int(rate))}/s{tail}"
    ]


def _plan_line(view: pb.AgreementStatus, plan: dict[str, Any] | None) -> str:
    parts = [f"plan {view.active_plan_id[:8]}"]
    stages = plan.get("stages") if plan else None
    if isinstance(stages, list):
        parts.append(f"{len(stages)} {'stage' if len(stages) == 1 else 'stages'}")
    else:
        parts.append(f"{len(view.members)} {'node' if len(view.members) == 1 else 'nodes'}")
    predicted = _predicted_tokens_per_s(plan)
    if predicted:
        parts.append(f"~{predicted:.1f} tok/s predicted")
    if view.members and len(view.confirmed_by) < len(view.members):
        parts.append(f"confirmed by {len(view.confirmed_by)}/{len(view.members)}")
    return " · ".join(parts)


def _pending_reasons(view: pb.AgreementStatus) -> list[str]:
    """The daemon's reasons why the plan is not (yet) committed, minus what is said elsewhere.

    The daemon joins its reasons with "; " and includes the refusal text; the refusal has its
    own line, so it is cut out before splitting.
    """
    text = view.reason.replace(view.refusal, "") if view.refusal else view.reason
    reasons = [part.strip() for part in text.split("; ")]
    reasons = [r for r in reasons if r and r != NO_MODEL_REASON]
    if len(reasons) > MAX_REASONS:
        reasons = [*reasons[: MAX_REASONS - 1], f"and {len(reasons) - MAX_REASONS + 1} more"]
    return reasons


def _node_line(node: pb.PeerStatus, layers: dict[str, str]) -> str:
    profile = node.profile
    head = f"{'●' if node.alive else '○'} {profile.node_id}"
    if profile.name and profile.name != profile.node_id:
        head += f" ({profile.name})"
    parts = [head]
    if profile.flops > 0:
        parts += [f"{format_bytes(profile.memory_budget)} budget", format_flops(profile.flops)]
    else:
        parts.append("measuring")
    if profile.node_id in layers:
        parts.append(layers[profile.node_id])
    parts.append(_seen(node))
    return " · ".join(parts)


def _seen(node: pb.PeerStatus) -> str:
    if node.source == "self":
        return "this node"
    if not node.alive:
        return f"lost, last seen {node.last_seen_s:.0f} s ago"
    return f"seen {node.last_seen_s:.1f} s ago"


def _memory_lines(memory: pb.RuntimeMemory) -> list[str]:
    """This node's memory next to its budget (and the plan's prediction while serving)."""
    if not memory.budget:
        return []
    used, budget = format_bytes(memory.mlx_active), format_bytes(memory.budget)
    line = f"this node: MLX {used} of {budget} budget"
    if memory.planned:
        line += f" (plan predicts {format_bytes(memory.planned)})"
    line += f" · RSS {format_bytes(memory.rss)}"
    if memory.overhead:
        line += f" (process overhead {format_bytes(memory.overhead)} planned)"
    return [line]


def _parse_plan(plan_json: str) -> dict[str, Any] | None:
    """The active plan as a dict, or None: a status app must not fail on a newer daemon's plan."""
    if not plan_json:
        return None
    try:
        plan = json.loads(plan_json)
    except ValueError:
        return None
    return plan if isinstance(plan, dict) else None


def _layers_by_node(plan: dict[str, Any] | None) -> dict[str, str]:
    """'layers 0-14' per node holding a stage of the plan."""
    layers: dict[str, str] = {}
    for stage in (plan or {}).get("stages") or []:
        try:
            text = f"layers {int(stage['layer_start'])}-{int(stage['layer_end']) - 1}"
            nodes = list(stage["nodes"])
        except (KeyError, TypeError, ValueError):
            continue
        layers.update(dict.fromkeys(nodes, text))
    return layers


def _predicted_tokens_per_s(plan: dict[str, Any] | None) -> float | None:
    prediction = (plan or {}).get("prediction")
    value = prediction.get("tokens_per_s") if isinstance(prediction, dict) else None
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _one_line(text: str, limit: int = MAX_ITEM_CHARS) -> str:
    """Menus hold single lines: collapse whitespace and newlines, cut long text."""
    return _shorten(" ".join(text.split()), limit)


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


# ---------------------------------------------------------------- the feed

MenuCallback = Callable[[Menu], None]


class StatusFeed:
    """Follows the daemon's status stream in a background thread and hands out Menus.

    `on_menu` is called from the feed's thread with every Menu that differs from the last one:
    a Menu per streamed status, or `menu_unreachable` when the daemon cannot be reached or the
    stream breaks. Reconnects wait `retry_min_s`, doubling up to `retry_max_s`, so a stopped
    daemon costs one cheap connect attempt every few seconds, never a busy loop. The daemon
    sends a status at least every 5 s; a stream silent for `stall_s` (a hung daemon) is
    cancelled and reopened. `close()` stops everything within about a second.
    """

    def __init__(
        self,
        api_address: str,
        on_menu: MenuCallback,
        *,
        min_interval_s: float = 0.5,
        retry_min_s: float = 0.5,
        retry_max_s: float = 5.0,
        stall_s: float = 15.0,
    ) -> None:
        if not 0 < retry_min_s <= retry_max_s:
            raise ValueError(
                f"retry_min_s ({retry_min_s}) must be > 0 and <= retry_max_s ({retry_max_s})"
            )
        self.api_address = api_address
        self._on_menu = on_menu
        self._min_interval_s = min_interval_s
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._stall_s = stall_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None  # the open WatchStatus call (cancellable from another thread)
        self._last_status_at = time.monotonic()
        self._stalled = False
        self._last_menu: Menu | None = None
        self._threads: list[threading.Thread] = []
        self.attempts = 0  # streams opened so far: shows the backoff at work

    def start(self) -> StatusFeed:
        if self._threads:
            raise RuntimeError("this StatusFeed is already started; make a new one to restart")
        for target, name in ((self._run, "status-feed"), (self._watchdog, "status-watchdog")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop following: cancel the open stream and wait for the threads to end."""
        self._stop.set()
        self._cancel_call()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def __enter__(self) -> StatusFeed:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ threads

    def _run(self) -> None:
        delay = self._retry_min_s
        while not self._stop.is_set():
            received, error_text = self._follow_stream()
            if self._stop.is_set():
                return
            self._deliver(menu_unreachable(error_text))
            if received:  # it was up a moment ago: a restart is worth a quick retry
                delay = self._retry_min_s
            self._stop.wait(delay)
            delay = min(delay * 2, self._retry_max_s)

    def _follow_stream(self) -> tuple[bool, str]:
        """Deliver a Menu per streamed status until the stream ends; (got any, why it ended)."""
        received = False
        self.attempts += 1
        request = pb.WatchStatusRequest(min_interval_s=self._min_interval_s)
        with grpc.insecure_channel(self.api_address) as channel:
            call = rpc.LocalStub(channel).WatchStatus(request)
            with self._lock:
                self._call, self._stalled = call, False
                self._last_status_at = time.monotonic()
            if self._stop.is_set():  # close() ran before the call existed
                call.cancel()
            try:
                for status in call:
                    self._last_status_at = time.monotonic()
                    received = True
                    self._deliver(menu_from_status(status))
            except grpc.RpcError as exc:
                return received, self._error_text(exc)
            finally:
                with self._lock:
                    self._call = None
        return received, f"the daemon closed the status stream\nAPI address: {self.api_address}"

    def _watchdog(self) -> None:
        """Cancel a stream that has been silent longer than stall_s (checked once a second)."""
        while not self._stop.wait(min(1.0, self._stall_s / 2)):
            with self._lock:
                silent = time.monotonic() - self._last_status_at
                if self._call is not None and silent > self._stall_s:
                    self._stalled = True
                    self._call.cancel()

    def _cancel_call(self) -> None:
        with self._lock:
            if self._call is not None:
                self._call.cancel()

    def _error_text(self, exc: grpc.RpcError) -> str:
        """Why the stream ended, then the address: menus cut long lines, the reason goes first."""
        if self._stalled:
            reason = f"the daemon sent no status for {self._stall_s:.0f} s (hung or overloaded?)"
        elif isinstance(exc, grpc.Call):
            reason = f"{exc.code().name}: {exc.details() or 'no details'}"
        else:
            reason = str(exc)
        return f"{reason}\nAPI address: {self.api_address}"

    def _deliver(self, menu: Menu) -> None:
        if menu == self._last_menu:
            return
        self._last_menu = menu
        try:
            self._on_menu(menu)
        except Exception:  # a drawing bug must not stop the feed
            log.exception("the status app's on_menu callback failed")
