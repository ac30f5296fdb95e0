"""The SGLang rollout engine: a fleet of SGLang servers behind the engine interface.

* ``options.py`` -- one server's options, once (``ServerConfig``: one default per value, written on
  a command line and read back) and SGLang's flags made of them (``server_command``).
* ``client.py`` -- one server over HTTP: its calls, ``/health``, the generation probe, its health
  state.
* ``server.py`` -- one server as a process of this one: launch, wait for health, stop; ``python -m``
  of it is the serve command (``serve.py``: one server in the foreground, what the Slurm launchers
  run per server).
* ``router.py`` -- sglang-router in front of several servers.
* ``routing.py`` -- MoE routing replay's routed experts: asked for, decoded from an answer.
* ``versions.py`` -- which SGLang release each version-bound setting needs, and the refusal.
* ``launch.py`` -- what ``server_command``'s command line runs inside the SGLang venv (SGLang's own launch with
  the API key taken from the environment); it imports nothing of this package.
* ``fleet.py`` -- the :class:`~megatron_tepo.rollout.engine.RolloutEngine` (``SGLangFleet``): its
  servers launched or attached, its settings, and its parts, one job each:
  ``dispatch.py`` (a step's requests spread over the servers, or through the router, retried
  elsewhere on failure), ``supervision.py`` (the servers' health: probes, restarts, what a weight
  sync gathers first), ``interruptible.py`` (partial rollout's submit, collect and interrupt) and
  ``memory.py`` (colocated mode's memory release and resume).
* ``weight_sync/`` -- the actor's weights pushed to every server, one module per mode
  (``distributed``, ``tensor``, ``disk``, ``ipc``) over a shared base.
* ``attach.py`` -- the engine a run config asks for (``rollout.engine: sglang``, registered with
  :mod:`megatron_tepo.rollout.registry`): the fleet attached to the configured servers, with its
  weight sync.

Nothing here imports Megatron; the SGLang package itself is imported only inside the servers' own
processes (``launch.py``). This file imports nothing, so that ``python -m`` of a module here runs
it once.
"""
