"""The Tinker routes of the service's HTTP front, one module per resource of the ``tinker`` SDK (0.38.0).

- :mod:`.base`: what every route does at the door: the caller's key, the body read, what it names checked
  to be the caller's, an ordered request's ``seq_id`` spent when it is refused, the work queued;
- :mod:`.sessions`: the client's session (``service.py``, ``telemetry.py``: health, config, sessions, its
  heartbeat) and its futures (``futures.py``: ``retrieve_future``);
- :mod:`.training`: training clients' models and steps (``models.py``, ``training.py``);
- :mod:`.weights`: saved states and sampler snapshots, and loading them (``weights.py``);
- :mod:`.sampling`: sampling sessions and ``asample`` (``service.py``, ``sampling.py``);
- :mod:`.rest`: the REST client's reads (training runs, checkpoints, weights info).

:func:`mlora_lab.service.app.create_app` composes them with the OpenAI-compatible routes
(:mod:`mlora_lab.service.openai_api`). Each module's ``routes(state)`` builds its routes when the app is
made, from the handlers the module holds then.
"""
