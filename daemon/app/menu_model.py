"""The app's whole menu as data: status lines, then the actions that make sense right now.

Front ends (pystray, rumps) turn `Entry` trees into their own menu items and call back with
the `Entry` that was clicked; which actions are offered and enabled in which state is
decided here, once, and tested for every state without a GUI.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshd.app.status_model import SEPARATOR, Menu, MeshState


class Action(enum.Enum):
    OPEN_DASHBOARD = "open the dashboard in the browser"
    SHOW_STATUS = "show the status text (until the daemon serves a dashboard)"
    COPY_TOKEN = "copy the mesh's join token to the clipboard"
    LOAD_MODEL = "select the model the mesh runs"
    LEAVE = "leave the mesh: stop the service"
    REJOIN = "rejoin the mesh: start the service"
    RESTART = "restart the service"
    OPEN_LOGS = "open the daemon's log"
    QUIT = "quit the app (the daemon keeps running)"


@dataclass(frozen=True)
class Entry:
    """One menu line: an action (enabled or not), an information line, or a separator."""

    label: str
    action: Action | None = None  # None: a line of information, never clickable
    enabled: bool = False
    argument: str = ""  # LOAD_MODEL: the model's name in the store
    checked: bool | None = None  # None: not a check item
    default: bool = False  # the action of a plain click on the icon
    children: tuple[Entry, ...] = ()

    @property
    def is_separator(self) -> bool:
        return self.label == SEPARATOR and self.action is None


SEPARATOR_ENTRY = Entry(SEPARATOR)


@dataclass(frozen=True)
class ServiceView:
    """What the app knows about the daemon's service (None fields: no service manager)."""

    installed: bool = False
    running: bool = False
    description: str = ""  # e.g. "systemd per-user unit meshd.service (...)"


@dataclass(frozen=True)
class AppContext:
    """Everything besides the mesh status that decides the menu."""

    service: ServiceView = ServiceView()
    models: tuple[str, ...] = ()  # names in the daemon's model store
    message: str = ""  # what the last action did, shown until the next one


LABELS = {
    Action.OPEN_DASHBOARD: "Open dashboard",
    Action.SHOW_STATUS: "Show status",
    Action.COPY_TOKEN: "Copy join token",
    Action.LOAD_MODEL: "Load model",
    Action.LEAVE: "Leave the mesh (stops the service)",
    Action.REJOIN: "Rejoin the mesh (starts the service)",
    Action.RESTART: "Restart the service",
    Action.OPEN_LOGS: "Open logs",
    Action.QUIT: "Quit meshd app",
}
NO_SERVICE_HINT = " (needs `meshd service install`)"


def app_menu(menu: Menu, context: AppContext) -> tuple[Entry, ...]:
    """The full menu: the title, the status lines, the last action's result, the actions."""
    lines = [Entry(menu.title)]
    lines += [SEPARATOR_ENTRY if item == SEPARATOR else Entry(item) for item in menu.items]
    if context.message:
        lines += [SEPARATOR_ENTRY, Entry(context.message)]
    return (*lines, SEPARATOR_ENTRY, *action_entries(menu, context))


def action_entries(menu: Menu, context: AppContext) -> tuple[Entry, ...]:
    """The actions, in a fixed order; only the enabled flags and labels follow the state."""
    reachable = menu.state is not MeshState.UNREACHABLE
    service = context.service
    if menu.dashboard_url:
        view = _entry(Action.OPEN_DASHBOARD, reachable, default=True, argument=menu.dashboard_url)
    else:
        view = _entry(Action.SHOW_STATUS, True, default=True)
    membership = Action.LEAVE if service.running else Action.REJOIN
    suffix = "" if service.installed else NO_SERVICE_HINT
    return (
        view,
        _entry(Action.COPY_TOKEN, reachable),
        _models_entry(menu, context, reachable),
        SEPARATOR_ENTRY,
        _entry(membership, service.installed, suffix=suffix),
        _entry(Action.RESTART, service.installed, suffix=suffix),
        _entry(Action.OPEN_LOGS, service.installed, suffix=suffix),
        SEPARATOR_ENTRY,
        _entry(Action.QUIT, True),
    )


def _entry(
    action: Action, enabled: bool, *, suffix: str = "", default: bool = False, argument: str = ""
) -> Entry:
    return Entry(
        LABELS[action] + suffix, action, enabled=enabled, default=default, argument=argument
    )


def _models_entry(menu: Menu, context: AppContext, reachable: bool) -> Entry:
    """A submenu of the store's models; the one the mesh runs is checked."""
    if not reachable or not context.models:
        label = LABELS[Action.LOAD_MODEL] + (" (the store is empty)" if reachable else "")
        return Entry(label, Action.LOAD_MODEL, enabled=False)
    children = tuple(
        Entry(
            name,
            Action.LOAD_MODEL,
            enabled=name != menu.model,
            argument=name,
            checked=name == menu.model,
        )
        for name in context.models
    )
    return Entry(LABELS[Action.LOAD_MODEL], Action.LOAD_MODEL, enabled=True, children=children)


def enabled_actions(entries: tuple[Entry, ...]) -> list[Entry]:
    """The clickable top-level entries in menu order (what keyboard navigation walks)."""
    return [entry for entry in entries if entry.action is not None and entry.enabled]
