"""The job's contract, as data: what a job, its tenants and their parts are, with every field's
bounds and meaning. The notebook side reads it without loading torch.

    job         JobSpec: a job (one base, its tenants, job-wide settings), read from and written to job.json
    tenant      Tenant: one LoRA adapter of a job, its data, held-out data, LoRA shape and optimizer
    parts       the nested parts: Parallel, RL, Preference, Eval, Service, ClientModel
    paths       where a spec's paths point: resolved against job.json's directory, written relative to it
    renames     renamed fields (eval_data, eval_every, serve), read under their old names with a warning
    fields      the field machinery: metadata, bounds, labels, Problem and SpecError
    outline     the outline of a job a form shows before it is valid

The public types are named here for code outside the package (``from mlora_lab.spec import JobSpec``);
modules of the package import each from the module that defines it.
"""

from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL, Eval, Parallel, Preference, Service
from mlora_lab.spec.tenant import Tenant

__all__ = ["RL", "Eval", "JobSpec", "Parallel", "Preference", "Service", "SpecError", "Tenant"]
