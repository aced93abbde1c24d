"""meshd as a background service: launchd (macOS) and systemd (Linux) files and commands.

`meshd service install | uninstall | start | stop | restart | status | logs` (see `cli`),
the files are rendered from the running installation (`units`), the service managers are
driven through their own command-line tools (`manager`), and the daemon tells systemd when
it serves (`notify`).
"""
