"""A served job's ``service`` settings (no file read): its fields, and no tenant named as its OpenAI endpoint names
the base (``base``).

The Tinker service runs on any layout (``parallel``: several processes, fsdp, tp, ep; rank 0 serves, the
other processes follow it: :mod:`mlora_lab.job.drivers.tinker.driver`), so nothing here depends on ``parallel``.
"""

from __future__ import annotations

from mlora_lab.rundir.service import reserved_model_names, served_base_name
from mlora_lab.spec.fields import fields_info
from mlora_lab.spec.parts import Service
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate.context import Context, got
from mlora_lab.validate.fields import check_field


def check_service(ctx: Context) -> None:
    """``service``'s fields against their :class:`~mlora_lab.spec.fields.FieldInfo`."""
    s = ctx.spec.service
    if s is None:
        return
    if not isinstance(s, Service):
        ctx.say(None, "service", f"service must be Service settings (an object) or null ({got(s)})")
        return
    for name, info in fields_info(Service):
        if name == "host" and s.host == "":  # (to a socket, "" is every interface: never by accident)
            ctx.say(
                None,
                "service.host",
                "service.host is empty: give the address to listen on, '127.0.0.1' for this machine only "
                "(the default) or '0.0.0.0' for every interface",
            )
            continue
        check_field(ctx, None, f"service.{name}", getattr(s, name), info)
    base = served_base_name(s.model_name, ctx.spec.base_model)
    reserved = reserved_model_names(base) if isinstance(base, str) else frozenset()
    for t in ctx.spec.tenants if isinstance(ctx.spec.tenants, list) else ():
        if isinstance(t, Tenant) and isinstance(t.name, str) and t.name in reserved:
            ctx.say(
                t,
                "name",
                f"{t.name!r} is what the job's OpenAI endpoint calls its base model: a tenant of a served job "
                "needs another name",
            )
