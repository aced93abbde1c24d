"""The data plane of one node: origin, stage, transport and tensor-parallel runners wired
together (`dataplane`), and the stage weights kept across plans (`loaded_stages`)."""
