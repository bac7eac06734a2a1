"""The Tinker-compatible training service, job side: what rank 0 of a served job runs for the programs that
drive their tenants through the ``tinker`` SDK (0.38.0), unchanged.

- :mod:`.app`: the HTTP front (Starlette + uvicorn on a thread): checks each request, queues it, answers
  futures; it never computes. :mod:`.routes`: its Tinker routes, one module per resource of the SDK
  (sessions, training, weights, sampling, REST). :mod:`.keys` (API keys), :mod:`.reading` (a body read and parsed, for both
  sides alike), :mod:`.bodies` (JSON bodies, checked); :mod:`.openai_api`, the OpenAI-compatible routes.
- :mod:`.work`: the inbox (every model's requests in ``seq_id`` order, a resend run once) and the futures,
  where the HTTP thread and the training loop meet; :mod:`.state`: the state both share (sessions, models,
  the inbox and futures).
- :mod:`.wire`: the protobuf wire format, with the SDK's own message classes.
- :mod:`.losses`: Tinker's built-in losses (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``,
  ``gspo``, ``dro``) as per-token sums over one forward of the shared base.

The training loop's side is :class:`mlora_lab.job.drivers.tinker.driver.ServiceDriver`, the loop's third driver.
Import the submodules themselves: this package imports nothing.
"""
