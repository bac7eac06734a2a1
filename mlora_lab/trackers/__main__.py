"""``python -m mlora_lab.trackers '<json>'``: the child process of :func:`mlora_lab.trackers.report`.

The argument is ``{"run", "to", "group", "logging_dir", "project"}``; the answer is one line on standard
output, after :data:`~mlora_lab.trackers.ANSWER`: ``{"where": {tracker: destination}}``, or
``{"error": sentence, "type": exception name}`` (exit code 1).
"""

from __future__ import annotations

import contextlib
import json
import sys

from mlora_lab.text import error_line
from mlora_lab.trackers import ANSWER, mirror_run


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    try:
        with contextlib.redirect_stdout(sys.stderr):  # what the trackers print is not the answer
            where = mirror_run(
                args["run"],
                args["to"],
                group=args["group"],
                logging_dir=args["logging_dir"],
                project=args["project"],
            )
    except Exception as e:
        try:  # every line: a SpecError lists its problems one per line
            text = str(e).strip()[:4000] or type(e).__name__
        except Exception:
            text = error_line(e)
        print(ANSWER + json.dumps({"error": text, "type": type(e).__name__}), flush=True)
        return 1
    print(ANSWER + json.dumps({"where": where}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
