"""The dashboard's background refresh: a daemon thread that runs a view's refresh every ``refresh_s``
seconds until nothing more can change, and that a failing refresh never ends. A refresh that fails (a
bad row, a figure that cannot be drawn, a file that went away for a moment) is logged, with its
traceback, once per distinct error, and said above the figures (:attr:`Refresher.problem`); the next one
is tried, and once one succeeds the message says the view recovered.

Built with what it runs (the refresh, whether more can change, what to do at the end) and the logger
to write to; it knows nothing else of the view.
"""

from __future__ import annotations

import html
import logging
import threading
import time
from collections.abc import Callable

import ipywidgets as W

from mlora_lab.lab.dashboard.figures import GREY, RED
from mlora_lab.text import error_line


class Refresher:
    """Runs ``refresh`` (which returns whether to go on) now and then in a thread (:meth:`start`)
    until it returns False or :meth:`stop`; then ``on_end``. After a refresh that raised, ``going()``
    says whether to go on."""

    def __init__(
        self,
        refresh: Callable[[], bool],
        refresh_s: float,
        going: Callable[[], bool],
        on_end: Callable[[], None],
        log: logging.Logger,
    ) -> None:
        self.refresh_s = refresh_s
        self.problem = W.HTML()
        """Why the last refresh failed (the view goes on refreshing), or that one failed earlier."""
        self._refresh, self._going, self._on_end, self._log = refresh, going, on_end, log
        self._failures: list[tuple[float, str]] = []  # (when, what) of refreshes that failed
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()

    def start(self) -> None:
        """Refresh now, and in the background thread (started once) unless nothing more can change."""
        if self.refresh_or_say() and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlora-dashboard", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop refreshing (after the refresh under way, if one is)."""
        self._stop_event.set()

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stop_event.is_set()

    @property
    def idle(self) -> bool:
        """Neither refreshing in the background nor stopped: never started, or nothing could change
        when it was."""
        return self._thread is None and not self._stop_event.is_set()

    @property
    def live(self) -> bool:
        """True while the background refresh runs."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop_event.wait(self.refresh_s):
            if not self.refresh_or_say():
                break
        self._on_end()

    def refresh_or_say(self) -> bool:
        """``refresh()``, whatever it raises: a refresh that fails is logged (with its traceback, once
        per distinct error) and shown above the figures, and the view goes on refreshing (a bad row,
        a figure that cannot be drawn, a file that went away for a moment must not end a live view).
        Returns whether to go on."""
        try:
            going = self._refresh()
        except Exception as e:
            self.say_failure("refresh", e)
            return self._going()  # keep going unless it is known that nothing more can change
        if self._failures and "failed" in self.problem.value and "recovered" not in self.problem.value:
            when, what = self._failures[-1]
            self.problem.value = (
                f"<div style='color:{GREY};font-size:12px'>{len(self._failures)} refresh(es) failed, the last "
                f"at {time.strftime('%H:%M:%S', time.localtime(when))} ({html.escape(what)}); "
                "recovered since (details in the log)</div>"
            )
        return going

    def say_failure(self, doing: str, e: Exception) -> None:
        """Log that ``doing`` (``refresh``, ``redraw``) failed, once per distinct error, and show it."""
        what = f"{type(e).__name__}: {error_line(e)}"
        if what not in {w for _, w in self._failures}:
            self._log.warning("the dashboard's %s failed: %s", doing, what, exc_info=True)
        self._failures.append((time.time(), what))
        del self._failures[:-100]
        self.problem.value = (
            f"<pre style='color:{RED};white-space:pre-wrap;margin:2px 0'>dashboard {doing} failed at "
            f"{time.strftime('%H:%M:%S')} ({len(self._failures)} so far): {html.escape(what)}\n"
            "it keeps refreshing; the traceback is in the log (logger mlora_lab.lab.dashboard)</pre>"
        )
