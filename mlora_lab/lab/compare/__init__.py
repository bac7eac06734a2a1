"""Comparing tenants and runs: the runs table, summaries, overlays, hyperparameters and generations side by side."""
