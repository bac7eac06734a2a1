"""Validation of a :class:`~mlora_lab.spec.job.JobSpec`: every problem at once, before anything starts.

    from mlora_lab.validate import check, problems, Validator, ValidationCache
    for p in problems(spec):                        # list[Problem], never raises
        print(p.tenant, p.field, p.message)         # str(p): "tenant 'alice': rank must be >= 1 (got 0)"
    check(spec)                                     # spec, or SpecError listing every problem

    form_validator = Validator(ValidationCache())  # what the notebook forms use: repeated checks of
    form_validator.problems(spec)                  # similar specs load the model once and scan a data
                                                   # file again only when it changes

A check never raises and starts no process: it reads the model's config (and builds the model on the
``meta`` device, which allocates nothing), the tokenizer, the tenants' data files (tokenized until one
row keeps a target token at ``seq_len``) and the headers of any ``init_adapter`` weights, so bad input
is reported before anything is launched. ``problems(spec, files=False)`` checks only the fields,
names, parallel layout and tenant set, reading no file: cheap enough for the training process to
re-check the ``job.json`` it starts from.

Field values are checked against each field's :class:`~mlora_lab.spec.fields.FieldInfo` (kind, bounds,
choices), the same metadata the forms build their inputs from. Each :class:`~mlora_lab.spec.fields.Problem`
names its tenant and field, so views place problems without parsing their text. Everything here
treats its input as hostile: a message repeats at most ~80 characters of a bad value
(:mod:`mlora_lab.text`).

The checks are cut by phase around one shared :class:`~mlora_lab.validate.context.Context` (the spec,
the cache, what was loaded, the problems found), run in this order by
:func:`~mlora_lab.validate.validator.run_checks`:

    fields.py     every field's type and range (no file read)
    parallel.py   the process layout; later, whether the model splits over tp and ep ranks
    service.py    a served job's settings (host, port, lora_alpha, queue)
    tenants.py    names and the tenant set (duplicates, case clashes)
    model.py      the base model, tokenizer, targets, slot modules, vocabulary, memory estimate
    files.py      data files and init adapters
    sweep.py      a sweep's search and every tenant it can give

Importing this package imports no torch: the model is built (on the meta device) only when a check
needs it.
"""

from mlora_lab.spec.fields import Problem
from mlora_lab.validate.context import ValidationCache
from mlora_lab.validate.introspect import all_linear_names, linear_target_options, model_target_names
from mlora_lab.validate.sweep import job_of_sweep, sweep_problems, sweep_slot_modules
from mlora_lab.validate.validator import Validator, check, problems, tenant_problems

__all__ = [
    "Problem",
    "ValidationCache",
    "Validator",
    "all_linear_names",
    "check",
    "job_of_sweep",
    "linear_target_options",
    "model_target_names",
    "problems",
    "sweep_problems",
    "sweep_slot_modules",
    "tenant_problems",
]
