"""Evaluations from the notebook: ``ml.evaluate``, its results (:class:`Evaluation`) and the eval table."""
