"""Handles on run directories: ``Run`` and the handles of runs that serve or search, attach, a run's logs, trials, usage and tenant rows."""
