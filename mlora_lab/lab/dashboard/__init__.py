"""The live dashboard (``ml.Dashboard``, ``run.dashboard()``), cut by concern:

- :mod:`.model`: what to show (runs, states, series, ETAs), without a widget;
- :mod:`.table`: the runs table of a view over several runs;
- :mod:`.progress`: the header and the tenants' progress rows;
- :mod:`.figures` and :mod:`.system`: the loss, lr + grad-norm and system figures, and the hover readout;
- :mod:`.rl`: RL tenants' reward panel and recent samples (made only when a run has RL rows);
- :mod:`.preference`: preference tenants' reward margins and accuracies (made only when a run has their rows);
- :mod:`.panels`: those figures as one view's, and which of them to redraw when;
- :mod:`.outputs`: the logs tab and export;
- :mod:`.sweep`: a search's view (trials table, config → objective);
- :mod:`.refresher`: the background refresh, which a failing refresh does not end;
- :mod:`.board`: :class:`Dashboard`, which assembles the widgets and refreshes them in a thread.

It works on run directories (a ``Run`` is one) and never imports the run's handle. ``Dashboard`` is
imported on first use, so the model can be used (and tested) without ipywidgets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlora_lab.lab.dashboard.board import Dashboard

__all__ = ["Dashboard"]


def __getattr__(name: str) -> Any:
    if name == "Dashboard":
        from mlora_lab.lab.dashboard.board import Dashboard

        return Dashboard
    raise AttributeError(f"module 'mlora_lab.lab.dashboard' has no attribute {name!r}")
