"""The app without its GUI: follows the daemon and its service, and carries out the actions.

A front end (pystray, rumps) draws `snapshot()` whenever `on_change` fires and hands clicked
entries to `perform()`. Threads and their owners:

- the `StatusFeed` threads follow `WatchStatus` (see status_model);
- one refresher thread asks the service manager for the service's state every few seconds,
  and the daemon for its store's models when the mesh's model changes or it comes back;
- one action thread runs clicked actions one at a time, so a slow one (a service restart,
  a model load) never blocks the GUI's loop and two clicks never race.

`close()` stops all three. Every failure of an action becomes the menu's message line.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from meshd.api import client
from meshd.app.desktop import Desktop, DesktopError
from meshd.app.menu_model import LABELS, Action, AppContext, Entry, ServiceView, app_menu
from meshd.app.status_model import Menu, MeshState, StatusFeed, menu_unreachable
from meshd.app.terminal import render
from meshd.models.store import DEFAULT_MODEL
from meshd.service.manager import Manager
from meshd.service.units import ServiceError
from meshd.wire import pb

log = logging.getLogger("meshd.app")

SERVICE_REFRESH_S = 5.0
LOG_LINES = 200
GRACEFUL_LEAVE_NOTE = "this node's requests in flight end (a graceful leave comes later)"


class AppController:
    """Status, service state and actions of the app, for any front end."""

    def __init__(
        self,
        api_address: str,
        on_change: Callable[[], None],
        *,
        service: Manager | None,
        desktop: Desktop | None = None,
        refresh_s: float = SERVICE_REFRESH_S,
    ) -> None:
        self.api_address = api_address
        self.service = service
        self.desktop = desktop or Desktop()
        self._on_change = on_change
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._menu = menu_unreachable("connecting to the daemon…")
        self._context = AppContext()
        self._models_for: str | None = None  # the mesh model the store list was fetched for
        self._feed = StatusFeed(api_address, self._on_menu)
        self._actions = ThreadPoolExecutor(max_workers=1, thread_name_prefix="app-action")
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._refresher = threading.Thread(
            target=self._refresh_loop, name="app-refresh", daemon=True
        )

    # ------------------------------------------------------------ lifetime

    def start(self) -> AppController:
        self._refresh_service()
        self._refresher.start()
        self._feed.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._feed.close(timeout_s)
        self._actions.shutdown(wait=False, cancel_futures=True)
        if self._refresher.is_alive():
            self._refresher.join(timeout_s)

    # ------------------------------------------------------------ what to draw

    def snapshot(self) -> tuple[Menu, tuple[Entry, ...]]:
        with self._lock:
            return self._menu, app_menu(self._menu, self._context)

    @property
    def state(self) -> MeshState:
        with self._lock:
            return self._menu.state

    def _on_menu(self, menu: Menu) -> None:
        with self._lock:
            before = self._menu
            self._menu = menu
        if menu.state is not MeshState.UNREACHABLE and (
            before.state is MeshState.UNREACHABLE or before.model != menu.model
        ):
            self._wake.set()  # the daemon came back, or the mesh's model changed
        self._changed()

    def _set_context(self, **changes: object) -> None:
        with self._lock:
            values = {**self._context.__dict__, **changes}
            self._context = AppContext(**values)  # type: ignore[arg-type]
        self._changed()

    def _changed(self) -> None:
        try:
            self._on_change()
        except Exception:  # a drawing bug must not stop the feed or the actions
            log.exception("the app's redraw failed")

    # ------------------------------------------------------------ background refresh

    def _refresh_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._refresh_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._refresh_service()
            self._refresh_models()

    def _refresh_service(self) -> None:
        if self.service is None:
            return
        try:
            state = self.service.state()
        except ServiceError as exc:
            log.warning("cannot read the service's state: %s", exc)
            return
        view = ServiceView(state.installed, state.running, self.service.describe())
        if view != self._context.service:
            self._set_context(service=view)

    def _refresh_models(self) -> None:
        with self._lock:
            menu = self._menu
        if menu.state is MeshState.UNREACHABLE or self._models_for == menu.model:
            return
        try:
            models = client.list_models(self.api_address)
        except client.DaemonUnreachable:
            return
        self._models_for = menu.model
        names = [m.name for m in models.models]
        if DEFAULT_MODEL not in names:  # imported from the meshd install on first use
            names.append(DEFAULT_MODEL)
        self._set_context(models=tuple(names))

    # ------------------------------------------------------------ actions

    def perform(self, entry: Entry) -> Future[str]:
        """Run the entry's action on the action thread; its result becomes the message."""
        return self._actions.submit(self._run_action, entry)

    def _run_action(self, entry: Entry) -> str:
        assert entry.action is not None
        try:
            message = self._handlers()[entry.action](entry)
        except (
            client.DaemonUnreachable,
            client.GenerationFailed,
            ServiceError,
            DesktopError,
        ) as exc:
            message = f"{LABELS[entry.action]} failed: {exc}"
            log.warning("%s", message)
        except Exception as exc:  # an action must never take the app down
            log.exception("%s failed", LABELS[entry.action])
            message = f"{LABELS[entry.action]} failed: {exc}"
        self._set_context(message=" ".join(message.split()))
        self._wake.set()  # the service or the model may have changed
        return message

    def _handlers(self) -> dict[Action, Callable[[Entry], str]]:
        return {
            Action.OPEN_DASHBOARD: self._open_dashboard,
            Action.SHOW_STATUS: self._show_status,
            Action.COPY_TOKEN: self._copy_token,
            Action.LOAD_MODEL: self._load_model,
            Action.LEAVE: self._leave,
            Action.REJOIN: self._rejoin,
            Action.RESTART: self._restart,
            Action.OPEN_LOGS: self._open_logs,
        }

    def _open_dashboard(self, entry: Entry) -> str:
        self.desktop.open_url(entry.argument)
        return f"opened {entry.argument}"

    def _show_status(self, _entry: Entry) -> str:
        command = [sys.executable, "-m", "meshd", "status", "--watch", "--api", self.api_address]
        if self.desktop.run_in_terminal(command):
            return "status opened in a terminal"
        with self._lock:
            menu = self._menu
        path = self.desktop.show_text("status.txt", render(menu, time.time()) + "\n")
        return f"status written to {path}"

    def _copy_token(self, _entry: Entry) -> str:
        reply = client.fetch_token(self.api_address)
        self.desktop.copy(reply.token)
        return (
            f"join token of mesh {reply.mesh_name} copied; on another machine: meshd join <token>"
        )

    def _load_model(self, entry: Entry) -> str:
        request = pb.LoadModelRequest(model=entry.argument)
        reply = client.load_model(self.api_address, request)
        self._models_for = None  # refetch: the selection changed
        return f"{reply.model}: {reply.message}"

    def _require_service(self) -> Manager:
        if self.service is None:
            raise ServiceError("no service manager on this platform (launchd or systemd)")
        return self.service

    def _leave(self, _entry: Entry) -> str:
        self._require_service().stop()
        self._refresh_service()
        return f"left the mesh: the service is stopped; {GRACEFUL_LEAVE_NOTE}"

    def _rejoin(self, _entry: Entry) -> str:
        self._require_service().start()
        self._refresh_service()
        return "rejoining the mesh: the service is starting"

    def _restart(self, _entry: Entry) -> str:
        self._require_service().restart()
        self._refresh_service()
        return f"the service restarted; {GRACEFUL_LEAVE_NOTE}"

    def _open_logs(self, _entry: Entry) -> str:
        service = self._require_service()
        if self.desktop.run_in_terminal(service.log_command(follow=True, lines=LOG_LINES)):
            return "logs opened in a terminal"
        log_path = getattr(service, "log_path", None)
        if log_path is not None:  # launchd: a plain log file the desktop can open
            self.desktop.open_file(log_path)
            return f"opened {log_path}"
        argv = service.log_command(follow=False, lines=LOG_LINES * 5)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        path = self.desktop.show_text("meshd.log", done.stdout or done.stderr)
        return f"the last log lines are in {path}"
