"""The status app: `meshd app`, a tray (pystray) or menu-bar (rumps) icon that follows the mesh.

Layers, from pure to platform: `status_model` (a status in lines, and the feed that follows
the daemon), `menu_model` (which actions the menu offers in which state), `icons` (one icon
per state, light and dark), `controller` (threads, service state, actions), then the front
ends `tray`, `macos` and `terminal`, the login items (`autostart`) and the command (`cli`).
"""
