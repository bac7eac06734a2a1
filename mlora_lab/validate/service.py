"""A served job's ``service`` settings (no file read): its fields.

The Tinker service runs on any layout (``parallel``: several processes, fsdp, tp, ep; rank 0 serves, the
other processes follow it: :mod:`mlora_lab.job.service`), so nothing here depends on ``parallel``.
"""

from __future__ import annotations

from mlora_lab.specbase import fields_info
from mlora_lab.specparts import Service
from mlora_lab.validate.context import Context, got
from mlora_lab.validate.fields import check_field


def check_service(ctx: Context) -> None:
    """``service``'s fields against their :class:`~mlora_lab.specbase.FieldInfo`."""
    s = ctx.spec.service
    if s is None:
        return
    if not isinstance(s, Service):
        ctx.say(None, "service", f"service must be Service settings (an object) or null ({got(s)})")
        return
    for name, info in fields_info(Service):
        check_field(ctx, None, f"service.{name}", getattr(s, name), info)
