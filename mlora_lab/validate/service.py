"""A served job's ``service`` settings (no file read): its fields, and the layout the service runs on.

The Tinker service runs on one process for now (:class:`mlora_lab.job.service.ServiceDriver`): a service job
has ``parallel.nproc * parallel.nnodes == 1``.
"""

from __future__ import annotations

from mlora_lab.spec import Parallel, Service, fields_info
from mlora_lab.text import is_int
from mlora_lab.validate.context import Context, got
from mlora_lab.validate.fields import check_field


def check_service(ctx: Context) -> None:
    """``service``'s fields against their :class:`~mlora_lab.spec.FieldInfo`, and one process."""
    s = ctx.spec.service
    if s is None:
        return
    if not isinstance(s, Service):
        ctx.say(None, "service", f"service must be Service settings (an object) or null ({got(s)})")
        return
    for name, info in fields_info(Service):
        check_field(ctx, None, f"service.{name}", getattr(s, name), info)
    p = ctx.spec.parallel
    if isinstance(p, Parallel) and is_int(p.nproc) and is_int(p.nnodes) and p.nproc * p.nnodes != 1:
        ctx.say(
            None,
            "parallel.nproc",
            f"the Tinker service runs on one process for now (got parallel.nproc*nnodes = "
            f"{p.nproc}*{p.nnodes}); serve with nproc=1 and nnodes=1",
        )
