"""The SGLang rollout engine: a fleet of SGLang servers behind the engine interface.

* ``weight_sync/`` -- the actor's weights pushed to every server, one module per mode
  (``distributed``, ``tensor``, ``disk``) over a shared base.

Nothing here imports Megatron. This file imports nothing, so that ``python -m`` of a module here
runs it once.
"""
