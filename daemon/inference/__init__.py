"""Inference: the plans a node serves and the data plane that generates across them.

Importing this package imports nothing (the modules that run MLX load it when imported).

Daemon side: ``installer`` (committed plans -> loaded stages, trio thread), ``router``
(the API's requests -> a plan, asyncio thread), ``fencing`` (which plans this node serves).
Data plane, by role (see ``dataplane`` for how a request flows): ``dataplane`` (the facade),
``transport`` (streams between nodes), ``origin`` (requests this node asks: the I/O; its
decisions, pure, in ``origin_core``: moves between plans, retries, failures; the client's
side of a request in ``origin_request``, what a client gets in ``generation_events``),
``stage_core`` and ``stage_events`` (a stage's decisions, pure; what it admits in
``stage_admission``, what it remembers in ``stage_state``), ``stage`` (runs them), ``engine``
(the MLX side), ``frames`` (wire <-> values), ``assignment`` (what a node is asked to serve).
Shared: ``errors`` (the one error type to the APIs), ``sampling``, ``shard`` (a model's
layers as a stage).
"""
