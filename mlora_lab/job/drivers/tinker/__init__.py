"""The Tinker driver: a served job's clients (the official ``tinker`` SDK, over HTTP) train and sample tenants.

- :mod:`.driver`: :class:`~.driver.ServiceDriver`, which turns the requests queued by the HTTP side
  (:mod:`mlora_lab.service`) into the job's steps and samples, and answers their futures;
- :mod:`.job_service`: :class:`~.job_service.JobService`, the HTTP server a served job's rank 0 runs, and the
  drivers of the other ranks;
- its parts, each built with what it needs: :mod:`.sessions` (the clients' models: made, brought back by a
  resume, paused when their client goes away), :mod:`.plan` (the request plan: each model's requests in
  ``seq_id`` order, the step they make, their answers), :mod:`.snapshots` (sampler snapshots, an adapter
  frozen for sampling while its tenant trains on, and the batched sampling) and :mod:`.saved_states` (a
  client's saved training states, weights and AdamW, loaded back into tenants).
"""
