"""The sweep: what a job searches (``<run_dir>/sweep.json``), and the tenant of each trial."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlora_lab.search.engine import Search
from mlora_lab.search.space import (
    Distribution,
    Objective,
    Strategy,
    space_from_dict,
    space_to_dict,
    strategy_from_dict,
    strategy_to_dict,
)

# -- the sweep: what a job searches ---------------------------------------------------------------------


@dataclass
class Sweep:
    """A search over tenant settings inside one job (``<run_dir>/sweep.json``): trial ``i`` is the
    tenant ``base`` with ``name = f"{prefix}{i:03d}"``, the trial's configuration applied and
    ``max_steps = budget``."""

    base: Any  # mlora_lab.spec.tenant.Tenant
    space: dict[str, Distribution]
    strategy: Strategy
    budget: int
    seed: int = 0
    objective: Objective = field(default_factory=Objective)
    prefix: str = "trial-"

    def trial_tenant(self, trial_id: int, config: dict[str, Any]) -> Any:
        """The tenant of trial ``trial_id`` with ``config`` (``pref.beta``: the ``beta`` of its ``pref``; a
        base tenant without one keeps none, which validation refuses: :func:`nested_problems`)."""
        values = _tenant_values(config)
        nested = {k.split(".", 1)[1]: values.pop(k) for k in list(values) if k.startswith("pref.")}
        tenant = dataclasses.replace(
            self.base, name=f"{self.prefix}{trial_id:03d}", max_steps=self.budget, **values
        )
        if nested and tenant.pref is not None:
            tenant = dataclasses.replace(tenant, pref=dataclasses.replace(tenant.pref, **nested))
        return tenant

    def nested_problems(self) -> list[str]:
        """A ``pref.<field>`` in the space of a base tenant that is not a preference tenant."""
        named = sorted(k for k in self.space if isinstance(k, str) and k.startswith("pref."))
        if named and getattr(self.base, "pref", None) is None:
            return [
                f"search space {', '.join(named)}: the base tenant {self.base.name!r} has no pref (it is not a "
                "preference tenant); give it pref=ml.Preference(...) or search other fields"
            ]
        return []

    def trial_id(self, name: str) -> int | None:
        """The trial a tenant name belongs to (None: not a trial of this sweep)."""
        rest = name[len(self.prefix) :] if name.startswith(self.prefix) else ""
        return int(rest) if rest.isdigit() and len(rest) >= 3 else None

    def search(self) -> Search:
        """A fresh :class:`Search` for this sweep."""
        return Search(self.space, self.strategy, self.budget, self.seed, self.objective)

    def to_dict(self) -> dict[str, Any]:
        return {
            "base": self.base.to_dict(),
            "space": space_to_dict(self.space),
            "strategy": strategy_to_dict(self.strategy),
            "budget": self.budget,
            "seed": self.seed,
            "objective": dataclasses.asdict(self.objective),
            "prefix": self.prefix,
        }

    def write(self, path: str | os.PathLike) -> None:
        """Write ``sweep.json`` at ``path`` (atomically); the base tenant's rows below the file's directory
        (a launch wrote them into the run) are named relative to it, as ``job.json`` names its tenants'."""
        from mlora_lab.rundir.files import atomic_write_json  # (rundir owns the files)
        from mlora_lab.spec.paths import relative_tenant_paths

        d = self.to_dict()
        relative_tenant_paths(d["base"], os.path.dirname(os.path.abspath(os.fspath(path))))
        atomic_write_json(path, d)

    @classmethod
    def read(cls, path: str | os.PathLike) -> Sweep:
        """Read ``sweep.json``; the base tenant's relative paths are relative to the file's directory.
        ``OSError`` or ``ValueError`` naming the problem otherwise."""
        from mlora_lab.spec.paths import resolve_tenant_paths

        sweep = cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        resolve_tenant_paths(sweep.base, os.path.dirname(os.path.abspath(os.fspath(path))))
        return sweep

    @classmethod
    def from_dict(cls, d: Any) -> Sweep:
        """From ``sweep.json``'s object; ``ValueError`` naming the problem otherwise."""
        from mlora_lab.spec.fields import SpecError
        from mlora_lab.spec.tenant import Tenant

        if not isinstance(d, dict):
            raise ValueError("sweep.json must hold a JSON object")
        unknown = set(d) - {"base", "space", "strategy", "budget", "seed", "objective", "prefix"}
        if unknown:
            raise ValueError(f"sweep.json: unknown keys {sorted(map(str, unknown))}")
        try:
            base = Tenant.from_dict(d["base"])
        except (KeyError, SpecError) as e:
            raise ValueError(f"sweep.json: base tenant: {e}") from None
        objective = d.get("objective", {})
        return cls(
            base=base,
            space=space_from_dict(d.get("space")),
            strategy=strategy_from_dict(d.get("strategy")),
            budget=d.get("budget"),
            seed=d.get("seed", 0),
            objective=Objective(**objective) if isinstance(objective, dict) else Objective(str(objective)),
            prefix=d.get("prefix", "trial-"),
        )


def _tenant_values(config: dict[str, Any]) -> dict[str, Any]:
    """A configuration as tenant field values (choices of lists come back as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
