"""meshd daemon: one process per machine that joins the inference mesh."""
