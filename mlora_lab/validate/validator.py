"""The order of the phases, and the entry points that run them: :class:`Validator` (with an optional
:class:`~mlora_lab.validate.context.ValidationCache`), :func:`problems`, :func:`check` and
:func:`tenant_problems`.

A check never raises and starts no process. With ``files=False`` only the phases that read no file
run (fields, parallel layout, names and the tenant set); the others read the model's config, the
tokenizer, the tenants' data files and the headers of their ``init_adapter`` weights.
"""

from __future__ import annotations

import dataclasses

from mlora_lab.spec.fields import MAX_SLOTS, Problem, SpecError
from mlora_lab.spec.job import JobSpec, effective_slot_modules
from mlora_lab.spec.parts import Parallel
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import error_line
from mlora_lab.validate.context import Context, ValidationCache, capped
from mlora_lab.validate.evals import check_eval_fields, check_eval_files
from mlora_lab.validate.fields import check_job_fields, check_tenant_fields
from mlora_lab.validate.files import check_data, check_init_adapter
from mlora_lab.validate.hub import fetch_hub_ids
from mlora_lab.validate.model import (
    check_generation_memory,
    check_memory,
    check_quantized_embeddings,
    check_slot_modules,
    check_targets,
    check_vocab,
    load_model_and_tokenizer,
)
from mlora_lab.validate.parallel import (
    check_expert_parallel,
    check_parallel,
    check_quantize,
    check_tensor_parallel,
)
from mlora_lab.validate.service import check_service
from mlora_lab.validate.tenants import check_tenant_set, existing_name_problems


def run_checks(ctx: Context, files: bool = True) -> list[Problem]:
    """Every phase over ``ctx.spec``, in order; the problems found (``ctx.out``), uncapped. May raise
    on a bug in a check: :meth:`Validator.problems` is what turns that into a problem."""
    s = ctx.spec
    check_job_fields(ctx)
    check_parallel(ctx)
    check_quantize(ctx)
    check_service(ctx)
    tenants = s.tenants if isinstance(s.tenants, list) else []
    if not isinstance(s.tenants, list):
        ctx.say(None, "tenants", f"tenants must be a list of Tenant (got {type(s.tenants).__name__})")
    good = []
    for i, t in enumerate(tenants):
        if isinstance(t, Tenant):
            good.append(t)
        else:
            ctx.say(None, "tenants", f"tenants[{i}] must be a Tenant (got {type(t).__name__})")
    check_tenant_set(ctx, tenants)
    for t in good:
        check_tenant_fields(ctx, t)
    evals = check_eval_fields(ctx)
    # Past the tenant cap the job is refused anyway; reading every tenant's files would only cost time.
    if not files or len(tenants) > MAX_SLOTS:
        return ctx.out
    good = fetch_hub_ids(ctx, good)  # (downloads a Hub id's snapshot: the checks below read it)
    load_model_and_tokenizer(ctx)
    for t in good:
        check_targets(ctx, t)
        check_data(ctx, t)
        check_init_adapter(ctx, t)
    check_eval_files(ctx, evals)
    check_slot_modules(ctx, good)
    check_expert_parallel(ctx)
    check_tensor_parallel(ctx)
    check_vocab(ctx)
    check_quantized_embeddings(ctx)
    check_memory(ctx, good)
    check_generation_memory(ctx, good)
    return ctx.out


class Validator:
    """Checks specs and reports every problem at once, as :class:`~mlora_lab.spec.fields.Problem` objects.

    :func:`problems` is ``Validator().problems(spec)``. With a :class:`ValidationCache`, repeated checks
    skip the slow steps (loading the model config and tokenizer, scanning unchanged data files).
    """

    def __init__(self, cache: ValidationCache | None = None) -> None:
        self.cache = cache
        """The cache consulted and filled by every check (``None``: nothing is remembered)."""

    def problems(self, spec: JobSpec, files: bool = True) -> list[Problem]:
        """Every problem of ``spec``, at most ``MAX_PROBLEMS`` of them; never raises, starts no process.

        ``files=False`` reads no file: only the fields, names, parallel layout and tenant set."""
        # Without a cache of its own, one check still keeps one: the tenants of a big spec share a few
        # data files (a sweep's share one), each scanned once instead of once per tenant.
        cache = self.cache if self.cache is not None else ValidationCache()
        try:
            return capped(run_checks(Context(spec, cache), files=files))
        except Exception as e:  # "never raises": a bug in a check is still reported, not thrown
            return _internal_error("spec", e)

    def tenant_problems(self, job: JobSpec, tenant: Tenant) -> list[Problem]:
        """Problems of adding ``tenant`` to the job ``job`` while it runs: the tenant's own fields and
        files, checked against the job's model, tokenizer, ``max_rank``, adapter slots and tenant names.
        Never raises."""
        if not isinstance(tenant, Tenant):
            return [Problem(None, None, f"tenant must be a Tenant (got {type(tenant).__name__})")]
        try:
            probe = dataclasses.replace(
                job,
                tenants=[tenant],
                slot_modules=effective_slot_modules(job),
                stay_up=False,
                parallel=Parallel(),
                output_dir=None,
            )
            # The probe holds only this tenant and the job's settings (valid: the job runs with them), so
            # every problem it finds is one of adding this tenant.
            return self.problems(probe) + existing_name_problems(job, tenant)
        except Exception as e:  # the same promise as Validator.problems
            return _internal_error("tenant", e)


def _internal_error(what: str, e: Exception) -> list[Problem]:
    return [
        Problem(
            None, None, f"internal error while validating the {what} ({type(e).__name__}: {error_line(e)})"
        )
    ]


def problems(spec: JobSpec, files: bool = True) -> list[Problem]:
    """Every problem with ``spec`` (:class:`~mlora_lab.spec.fields.Problem`, each naming its tenant and field),
    at most ``MAX_PROBLEMS``. Never raises; starts no process; remembers nothing (a form that checks
    on every change uses ``Validator(ValidationCache())``). Checks that need the model are skipped
    when it cannot be loaded.

    Reads the model's config (building the model on the ``meta`` device, which allocates nothing),
    the tokenizer, the tenants' data files (tokenized until one row keeps a target token at
    ``seq_len``) and the headers of ``init_adapter`` weights. ``files=False`` runs only the checks of
    the fields, names, parallel layout and tenant set, reading no file: cheap enough for the training
    process to re-check the ``job.json`` it starts from.
    """
    return Validator().problems(spec, files=files)


def check(spec: JobSpec, files: bool = True) -> JobSpec:
    """``spec`` itself if it has no problems, else ``SpecError`` listing every one (:func:`problems`)."""
    found = problems(spec, files=files)
    if found:
        raise SpecError(found)
    return spec


def tenant_problems(job: JobSpec, tenant: Tenant) -> list[Problem]:
    """:meth:`Validator.tenant_problems` without a cache (what ``Run.add_tenant`` and the job use)."""
    return Validator().tenant_problems(job, tenant)
