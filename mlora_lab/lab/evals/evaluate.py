"""``ml.evaluate``: compare adapters by what they do. Every chosen model (the base, a run's tenants, adapter
folders) completes every example in one batched generation, each row with its own adapter
(:mod:`mlora_lab.evals.generate`); metrics with TRL's reward signature score the completions in an isolated
worker; the result (:class:`~mlora_lab.lab.evals.evaluation.Evaluation`) is saved in the run.

Like :func:`~mlora_lab.lab.compare.generations.compare_generations`, it imports torch and transformers when called,
so importing the lab loads neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlora_lab import hub
from mlora_lab.evals.metrics import BUILTINS, WinRate, metric_ref
from mlora_lab.lab.evals.evaluation import Evaluation
from mlora_lab.lab.runs.attach import attach
from mlora_lab.lab.runs.run import Run
from mlora_lab.rundir import TenantState
from mlora_lab.rundir.evals import NAME, EvalMeta, eval_dir, write_eval
from mlora_lab.rundir.files import atomic_write_bytes
from mlora_lab.sources import RewardSnapshot, reward_in_memory, source_name
from mlora_lab.spec.paths import resolve_reward
from mlora_lab.text import brief, shown_text

Metric = str | Callable[..., Any]
"""A metric: a built-in's name (``"exact_match"``), a reward reference (``"module:function"``,
``"path/to/file.py:function"``) or a function (a notebook's ``def``, pickled by value for the worker)."""


@dataclass
class _Source:
    """Where the models come from: a base and the adapters that may be evaluated over it."""

    base_model: str
    revision: str | None
    tokenizer: str | None
    adapters: dict[str, Path]  # name -> PEFT adapter folder
    slot_modules: Any
    max_rank: int
    run: Run | None
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    """The run's tenants that failed (quarantined: their adapter is what they had when their step went
    wrong) and why: left out of the default models."""


def _source(source: Any) -> _Source:
    """A run (live or finished, served, a sweep's), a run directory, or a list of PEFT adapter folders."""
    from mlora_lab.lora.targets import ALL_LINEAR
    from mlora_lab.spec.job import effective_slot_modules

    if isinstance(source, str | os.PathLike) and (Path(source) / "adapter_config.json").is_file():
        source = [source]
    if isinstance(source, str | os.PathLike):
        source = attach(source)
    if isinstance(source, Run):
        spec = source.spec
        adapters = {}
        for t in spec.tenants:
            path = source.dir.adapter(t.name)
            if (path / "adapter_config.json").is_file():
                adapters[t.name] = path
        last = source.last_tenant_rows()
        failed = {
            name: row.reason or "no reason was recorded"
            for name, row in last.items()
            if row.state is TenantState.FAILED and name in adapters
        }
        return _Source(
            spec.base_model,
            spec.revision,
            spec.tokenizer,
            adapters,
            effective_slot_modules(spec),
            spec.max_rank,
            source,
            failed,
        )
    if isinstance(source, Sequence) and source and all(isinstance(p, str | os.PathLike) for p in source):
        adapters, bases, ranks = {}, set(), []
        for p in map(Path, source):
            config_file = p / "adapter_config.json"
            if not config_file.is_file():
                raise ValueError(
                    f"evaluate: {p} is not a PEFT adapter folder (it has no adapter_config.json)"
                )
            config = json.loads(config_file.read_text(encoding="utf-8"))
            bases.add(config.get("base_model_name_or_path"))
            ranks.append(_rank(config))
            adapters[p.name] = p
        if len(adapters) != len(source):
            raise ValueError(
                "evaluate: two adapter folders have the same name; give folders of distinct names"
            )
        if len(bases) != 1 or None in bases:
            raise ValueError(
                f"evaluate: the adapters must name one base model (base_model_name_or_path); they name {sorted(map(str, bases))}"
            )
        return _Source(bases.pop(), None, None, adapters, ALL_LINEAR, max(ranks), None)
    raise TypeError(
        f"evaluate: source is a run, a run directory or a list of PEFT adapter folders, not {type(source).__name__}"
    )


def _rank(config: dict) -> int:
    """A PEFT adapter's rank (its config's ``r``, with ``rank_pattern``'s larger ones)."""
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def _metric_names(refs: list[str]) -> list[str]:
    from mlora_lab.evals.generate import metric_names

    return metric_names(refs)


def _function_refs(
    values: Sequence[Any], labels: Sequence[str], folder: Path, root: Path | None
) -> tuple[list[Any], list[str]]:
    """``(references, problems)`` of an environment's functions (``env``, ``tools``), as a launch makes them of
    an agent tenant's: a reference kept (a relative file made absolute, a ``"verifiers:<id>"`` as it is), a
    function or a verifiers object pickled by value into ``folder``. Their shapes were checked before."""
    from mlora_lab.validate.agents import VERIFIERS_PREFIX

    refs, problems = [], []
    for i, (v, label) in enumerate(zip(values, labels, strict=True)):
        if isinstance(v, str):
            refs.append(v if v.startswith(VERIFIERS_PREFIX) else resolve_reward(v, os.getcwd()))
            continue
        try:
            snap = RewardSnapshot.of(v)
        except Exception as e:
            problems.append(f"{label} ({brief(v)}) cannot be pickled for the env worker: {e}")
            continue
        path = folder / f"{i}-{snap.name}.pkl"
        atomic_write_bytes(path, snap.data, root=root)
        refs.append(f"{path}:{snap.name}")
    return refs, problems


def _metric_refs(metrics: Sequence[Metric], folder: Path, root: Path | None) -> tuple[list[str], list[str]]:
    """``(references, problems)``: built-ins by their module, files made absolute, functions pickled into
    ``folder`` (in the run when there is one: the evaluation keeps the metric it was scored with)."""
    refs, problems = [], []
    for i, m in enumerate(metrics):
        if isinstance(m, str):
            ref = metric_ref(m)
            refs.append(ref if ref != m else resolve_reward(m, os.getcwd()))
        elif reward_in_memory(m):
            try:
                snap = RewardSnapshot.of(m)
            except Exception as e:
                problems.append(f"metric {i} ({brief(m)}) cannot be pickled for the worker: {e}")
                continue
            path = folder / f"{i}-{snap.name}.pkl"
            atomic_write_bytes(path, snap.data, root=root)
            refs.append(f"{path}:{snap.name}")
        else:
            problems.append(
                f"metric {i} must be a built-in name ({', '.join(BUILTINS)}), 'module:function' or a function, not {brief(m)}"
            )
    return refs, problems


def evaluate(
    source: Any,
    data: Any,
    metrics: Sequence[Metric] = (),
    models: Sequence[str] | None = None,
    *,
    env: Any = None,
    env_args: dict[str, Any] | None = None,
    tools: Sequence[Any] = (),
    max_turns: int = 8,
    turn_timeout_s: float = 60.0,
    rollout_timeout_s: float = 600.0,
    name: str | None = None,
    num_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    stop: Sequence[str] = (),
    limit: int | None = None,
    timeout_s: float = 60.0,
    save: bool = True,
) -> Evaluation:
    """Generate with every chosen model on ``data``'s prompts in one batch, score with ``metrics``, and
    (for a run, ``save=True``) keep the result in ``<run>/evals/<name>/``.

    - ``source``: a run (a ``Run``, a served run, a sweep's run, a run directory) or PEFT adapter folders.
    - ``data``: any tenant data source (a file, a DataFrame, rows, a ``datasets.Dataset``, ``ml.HubDataset``)
      whose rows hold ``prompt`` (text or messages) or ``messages``, and any other columns (``answer``...),
      which metrics take by name. A supervised chat row is asked its turns but the last, whose answer
      becomes its ``reference``.
    - ``metrics``: :data:`Metric` s; the built-ins are ``exact_match``, ``contains``, ``regex``,
      ``numeric_match`` (GSM8K) and ``rouge`` (:mod:`mlora_lab.evals.metrics`); ``ml.Judge`` rates each
      completion, ``ml.WinRate(judge, against="base")`` is each model's win rate against the base's
      completions (or a tenant's, or a column's: ``against="chosen"`` for preference rows, whose prompts
      are asked and whose ``chosen`` answer is the ``reference``).
    - ``models``: ``"base"``, tenants' names, adapter folders' names, or more PEFT adapter folders over the
      same base (a served run's sampler snapshot: ``svc.local_path("tinker://...")``), each named by its
      folder; default the base and every adapter of the source but those of tenants that failed
      (quarantined: a warning names them and why, and the evaluation's ``meta.left_out`` keeps it; named
      here, such a tenant is evaluated).
    - ``num_samples`` with a ``temperature`` > 0 gives pass@k; ``temperature=0`` is greedy.
    - ``env`` / ``tools``: agent environments as benchmarks, the same ones agent tenants train on
      (``ml.RL(env=, env_args=, tools=, max_turns=, turn_timeout_s=, rollout_timeout_s=)``): a rollout
      function ``rollout(client, model, example, **env_args)`` (a function, ``"module:function"``,
      ``"file.py:function"``), a verifiers environment, or ``tools=[fn, ...]`` with the built-in tool loop.
      Each model plays ``num_samples`` episodes of every example, every model's waiting turns sampled together
      (:mod:`mlora_lab.evals.episodes`); the env's own reward is the score column ``env`` (its rubric's parts
      ``env/<part>``), and ``metrics`` (optional with ``env``) score whole conversations (``completions``: the
      messages from the model's first answer on). A row's completion is the conversation after the prompt as
      text; its ``episode`` column holds the messages, turns, stop reason and rubric.

    Every problem with the arguments (unknown models, metrics that cannot be loaded or do not take the rows'
    columns, bad rows, an env or tools that cannot be played) is raised as one ``ValueError`` before any model
    is loaded."""
    problems = []
    for field, value, ok in (
        ("num_samples", num_samples, isinstance(num_samples, int) and num_samples >= 1),
        ("max_new_tokens", max_new_tokens, isinstance(max_new_tokens, int) and max_new_tokens >= 1),
        ("temperature", temperature, isinstance(temperature, int | float) and temperature >= 0),
        ("top_p", top_p, isinstance(top_p, int | float) and 0 < top_p <= 1),
        ("limit", limit, limit is None or (isinstance(limit, int) and limit >= 1)),
    ):
        if not ok:
            problems.append(f"{field} = {brief(value)} is out of range")
    agent = env is not None or (isinstance(tools, list | tuple) and bool(tools))
    if isinstance(metrics, str | bytes) or callable(metrics) or (not metrics and env is None):
        problems.append(
            "metrics must be a non-empty list (of built-in names, 'module:function' or functions)"
            + (" (the tool loop gives no reward of its own: its conversations need metrics)" if agent else "")
        )
        metrics = []
    env_problems = (
        _agent_problems(env, env_args, tools, max_turns, turn_timeout_s, rollout_timeout_s, top_p)
        if agent or env_args
        else []
    )
    problems += env_problems
    name = name or time.strftime("eval-%Y%m%d-%H%M%S")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        problems.append(f"name {brief(name)} must be letters, digits, '.', '_', '-' (it names a folder)")
        name = "eval"
    src = _source(source)
    left_out = {} if models is not None else src.failed
    chosen = []
    for m in (
        list(models) if models is not None else ["base", *(a for a in src.adapters if a not in left_out)]
    ):
        folder = Path(m) if isinstance(m, str | os.PathLike) else None
        if folder is not None and (folder / "adapter_config.json").is_file():  # a snapshot's folder, say
            src.adapters.setdefault(folder.name, folder)
            src.max_rank = max(
                src.max_rank, _rank(json.loads((folder / "adapter_config.json").read_text("utf-8")))
            )
            m = folder.name
        chosen.append(m)
    choices = ["base", *src.adapters]
    unknown = [m for m in chosen if m not in choices]
    if unknown:
        problems.append(
            f"unknown model(s) {', '.join(map(repr, unknown))}; this source has {', '.join(choices)}"
        )
    baselines, columns_needed = _baselines(list(metrics), chosen, choices, problems)
    root = src.run.path if (src.run is not None and save) else None
    with contextlib.ExitStack() as stack:
        if root is not None:  # (the evaluation keeps the metrics (and env) it was scored with)
            work = eval_dir(root, name)
        else:  # adapter folders, or not saved: the pickled functions only live while it runs
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mlora-eval-")))
        refs, metric_problems = _metric_refs(list(metrics), work / "metrics", root)
        problems += metric_problems
        episodes = None
        if agent and not env_problems:  # (their shapes are right: pickled now, the metrics' way)
            tools = list(tools)
            labels = ["env"] * (env is not None) + [f"tools[{i}]" for i in range(len(tools))]
            played, pickle_problems = _function_refs(
                [*([env] if env is not None else []), *tools], labels, work / "env", root
            )
            problems += pickle_problems
            episodes = _Episodes(
                env=played[0] if env is not None else None,
                tools=played[1:] if env is not None else played,
                env_args=dict(env_args or {}),
                max_turns=max_turns,
                turn_timeout_s=float(turn_timeout_s),
                rollout_timeout_s=float(rollout_timeout_s),
                shown=_shown_env(env),
            )
        if episodes is not None and "env" in _metric_names(refs):
            problems.append("a metric is named 'env': that is the column of the env's own reward; rename it")
        if problems:
            raise ValueError("evaluate:\n  - " + "\n  - ".join(problems))
        return _evaluate(src, data, refs, chosen, name, root, num_samples, temperature, top_p, max_new_tokens,
                         seed, stop, limit, timeout_s, left_out, baselines, columns_needed, episodes)  # fmt: skip


def _shown_env(env: Any) -> str:
    """How an error names an evaluation's environment: its reference, its function's name, its type."""
    if env is None:
        return "the tool loop"
    if isinstance(env, str):
        return f"env {brief(env)}"
    name = getattr(env, "__qualname__", None) or type(env).__name__
    return f"env {shown_text(str(name), 80)}"


@dataclass
class _Episodes:
    """An evaluation's environment, checked and with its functions as references (the env worker's)."""

    env: str | None
    tools: list[str]
    env_args: dict[str, Any]
    max_turns: int
    turn_timeout_s: float
    rollout_timeout_s: float
    shown: str  # (how errors name it)


def _agent_problems(
    env: Any,
    env_args: Any,
    tools: Any,
    max_turns: Any,
    turn_timeout_s: Any,
    rollout_timeout_s: Any,
    top_p: Any,
) -> list[str]:
    """Everything wrong with an evaluation's environment, checked as an agent tenant's fields are
    (:mod:`mlora_lab.validate.agents`): the env a function, a reference or a verifiers env; tools a list of
    functions with tool schemas and distinct names; env_args JSON keyword arguments of an env; the limits
    positive; sampling with every token allowed (as agent tenants sample); the openai client installed."""
    import importlib.util

    from mlora_lab.sources import verifiers_object
    from mlora_lab.validate.agents import VERIFIERS_PREFIX, check_tools, function_problem

    def named(p: str) -> str:  # (the spec's words for the same fields: rl.env -> env)
        return p.replace("rl.env", "env", 1).replace("rl.tools", "tools", 1)

    problems = []
    if env is not None and (p := function_problem(env, "rl.env")):
        problems.append(named(p))
    if not isinstance(tools, list | tuple):
        problems.append(f"tools must be a list of functions, not {brief(tools)}")
        tools = []
    problems += [named(p) for i, v in enumerate(tools) if (p := function_problem(v, f"rl.tools[{i}]"))]
    verifiers = (isinstance(env, str) and env.startswith(VERIFIERS_PREFIX)) or verifiers_object(env)
    if verifiers and tools:
        problems.append(
            "tools are not used by a verifiers environment (env): its tools are its taskset's toolsets"
        )
    if env_args is not None:
        if not isinstance(env_args, dict) or not all(isinstance(k, str) for k in env_args):
            problems.append(f"env_args must be a dict with text keys, not {brief(env_args)}")
        else:
            try:
                json.dumps(env_args, allow_nan=False)
            except (TypeError, ValueError) as e:
                problems.append(f"env_args must hold JSON values only: {e}")
        if env_args and env is None:
            problems.append("env_args are the keyword arguments of env, and there is no env")
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        problems.append(f"max_turns = {brief(max_turns)} must be a positive integer")
    for field, v in (("turn_timeout_s", turn_timeout_s), ("rollout_timeout_s", rollout_timeout_s)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < float("inf"):
            problems.append(f"{field} = {brief(v)} must be a positive number of seconds")
    if isinstance(top_p, int | float) and top_p != 1:
        problems.append(
            f"top_p = {top_p:g}: an environment's episodes sample with every token allowed (top_p=1)"
        )
    if importlib.util.find_spec("openai") is None:
        problems.append("an environment's episodes call the models through the openai client, which is not "
                        "installed: pip install 'mlora_lab[openai]'")  # fmt: skip

    class _Said:  # (the tools' checks say their problems to a spec's context: collect them)
        def say(self, owner: Any, field: Any, message: str, path: Any = None) -> None:
            problems.append(named(message))

    if tools:
        check_tools(_Said(), None, [f for f in tools if reward_in_memory(f) or isinstance(f, str)])  # type: ignore[arg-type]
    return problems


def _baselines(
    metrics: list[Any], chosen: list[str], choices: list[str], problems: list[str]
) -> tuple[list[str], dict[str, str]]:
    """``(models, columns)`` the :class:`~mlora_lab.evals.metrics.WinRate` metrics compare with: the chosen
    models they name (their completions then reach the metrics), and ``{column: metric}`` for the others,
    which the rows must have. A model of the source left out of ``models`` is a problem saying to add it."""
    models, columns = [], {}
    for m in metrics:
        if not isinstance(m, WinRate):
            continue
        if m.against in chosen:
            models.append(m.against)
        elif m.against in choices:
            problems.append(
                f"metric {m.__name__} compares every model with {m.against!r}, which is not evaluated: "
                f"add {m.against!r} to models"
            )
        else:
            columns[m.against] = m.__name__
    return list(dict.fromkeys(models)), columns


def _evaluate(
    src: _Source,
    data: Any,
    refs: list[str],
    chosen: list[str],
    name: str,
    root: Path | None,
    num_samples: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    stop: Sequence[str],
    limit: int | None,
    timeout_s: float,
    left_out: dict[str, str],
    baselines: list[str],
    columns_needed: dict[str, str],
    episodes: _Episodes | None = None,
) -> Evaluation:
    """:func:`evaluate` once its arguments are checked: the tokenizer, the examples and the metrics'
    signatures (their problems, still before a model loads), then the models, generation and scores."""
    import torch
    import transformers

    from mlora_lab.bases import no_progress_bars, resolve_base
    from mlora_lab.data import DataError
    from mlora_lab.evals.episodes import EPISODE_COLUMN, EpisodeEvalError, run_episodes
    from mlora_lab.evals.generate import metric_names, read_examples, run_eval
    from mlora_lab.lora import MultiLoRAModel
    from mlora_lab.rl.rewards import RewardSignature, inspect_rewards

    problems: list[str] = []

    base_path = str(resolve_base(src.base_model, revision=src.revision))
    tok_path = str(hub.resolve(src.tokenizer)) if src.tokenizer else base_path
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_path)
    try:
        examples = read_examples(data, tokenizer, limit)
    except DataError as e:  # (every bad row, with the metrics' problems, in the one error)
        examples, problems = [], list(e.problems)
    columns = {k for ex in examples for k in ex.columns}
    for sig in inspect_rewards(refs, cwd=os.getcwd()):
        problems += (
            sig.problems(columns if examples else None) if isinstance(sig, RewardSignature) else [str(sig)]
        )
    for column, metric in columns_needed.items() if examples else ():
        if column not in columns:
            problems.append(
                f"metric {metric} compares every model with {column!r}, which is neither a model of this "
                f"evaluation ({', '.join(chosen)}) nor a column of its rows ({', '.join(sorted(columns)) or 'none'})"
            )
    if episodes is not None:
        taken = sorted({e for e, ex in enumerate(examples) if EPISODE_COLUMN in ex.columns})
        if taken:
            problems.append(
                f"{source_name(data)} rows {', '.join(map(str, taken[:5]))} have a column {EPISODE_COLUMN!r}: an "
                "environment's evaluation keeps each episode under that name; rename the column"
            )
    if not examples and not problems:
        problems.append(f"{source_name(data)} has no rows")
    if problems:
        raise ValueError("evaluate:\n  - " + "\n  - ".join(problems))
    if left_out:  # (said once the call is known to go ahead)
        warnings.warn(
            "evaluate: left out "
            + "; ".join(f"tenant {t!r}, which failed ({shown_text(why, 300)})" for t, why in left_out.items())
            + ". Name a tenant in models= to evaluate its adapter anyway.",
            stacklevel=3,
        )

    started = time.monotonic()
    with no_progress_bars():
        base = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    adapters = [m for m in chosen if m != "base"]
    mm = MultiLoRAModel(
        base, max_tenants=max(1, len(adapters)), max_rank=src.max_rank, slot_modules=src.slot_modules
    )
    for m in adapters:
        mm.load_adapter(m, src.adapters[m])
    names = metric_names(refs)
    if episodes is not None:  # (run_episodes plays under no_grad itself)
        try:
            rows, names = run_episodes(
                mm, tokenizer, examples, chosen, refs, env=episodes.env, tools=episodes.tools,
                env_args=episodes.env_args, names=names, num_samples=num_samples, temperature=float(temperature),
                max_new_tokens=max_new_tokens, max_turns=episodes.max_turns,
                turn_timeout_s=episodes.turn_timeout_s, rollout_timeout_s=episodes.rollout_timeout_s, seed=seed,
                stop=stop, timeout_s=timeout_s, cwd=os.getcwd(), baselines=baselines, shown_env=episodes.shown,
            )  # fmt: skip
        except EpisodeEvalError as e:
            raise RuntimeError(f"evaluate: {e}") from None
    else:
        with torch.no_grad():
            rows = run_eval(
                mm,
                tokenizer,
                examples,
                [(m, None if m == "base" else m) for m in chosen],
                refs,
                names=names,
                num_samples=num_samples,
                temperature=float(temperature),
                top_p=float(top_p),
                max_new_tokens=max_new_tokens,
                seed=seed,
                stop=stop,
                timeout_s=timeout_s,
                baselines=baselines,
            )
    meta = EvalMeta(
        name=name,
        models=chosen,
        metrics=names,
        data=source_name(data),
        examples=len(examples),
        num_samples=num_samples,
        temperature=float(temperature),
        top_p=float(top_p),
        max_new_tokens=max_new_tokens,
        seed=seed,
        seconds=time.monotonic() - started,
        left_out=dict(left_out),
    )
    saved = write_eval(root, meta, rows) if root is not None else None
    return Evaluation(meta, rows, folder=saved)
