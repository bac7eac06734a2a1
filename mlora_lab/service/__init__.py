"""The Tinker-compatible training service, job side: what rank 0 of a served job computes for the programs
that drive their tenants through the ``tinker`` SDK (0.38.0; its wire protocol is mapped in the project's
notes).

- :mod:`mlora_lab.service.losses`: Tinker's built-in losses (``cross_entropy``, ``importance_sampling``,
  ``ppo``, ``cispo``, ``dro``) as per-token sums over one forward of the shared base, their checks (one
  error naming every problem of a request) and the metrics the SDK merges.

More modules (the HTTP front, the request queue, the protobuf codec) come later. Import the submodules
themselves: this package imports nothing.
"""
