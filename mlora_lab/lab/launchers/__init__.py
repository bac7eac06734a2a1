"""How a job is started, followed and ended on an engine: the launcher seam and its engines."""
