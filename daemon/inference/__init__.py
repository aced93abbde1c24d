"""Inference: the plans a node serves and the data plane that generates across them.

Importing this package imports nothing (the modules that run MLX load it when imported).

Daemon side: ``installer`` (committed plans -> loaded stages, trio thread), ``router``
(the API's requests -> a plan, asyncio thread), ``fencing`` (which plans this node serves).
Data plane, by role (see ``dataplane`` for how a request flows): ``dataplane`` (the facade),
``transport`` (streams between nodes), ``origin`` (requests this node asks), ``stage_core``
and ``stage_events`` (a stage's decisions, pure), ``stage`` (runs them), ``engine`` (the MLX
side), ``frames`` (wire <-> values), ``assignment`` (what a node is asked to serve).
Shared: ``errors`` (the one error type to the APIs), ``sampling``, ``shard`` (a model's
layers as a stage).
"""
