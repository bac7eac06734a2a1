"""The spec's nested parts: the small dataclasses that ``JobSpec`` and ``Tenant`` each hold one of (or
``None``), each with its own corner of ``job.json``.

* :class:`Parallel` (``JobSpec.parallel``): how the job is laid out over processes;
* :class:`Service` (``JobSpec.service``): the job also serves the Tinker API;
* :class:`RL` (``Tenant.rl``): the tenant learns from rewards (GRPO) instead of fixed rows;
* :class:`Preference` (``Tenant.pref``): the tenant learns from preference pairs (DPO and its family);
* :class:`ClientModel` (``Tenant.client``): the Tinker model behind a served job's tenant.

Each is self-contained: it reads and writes its own dict (``to_dict`` / ``from_dict``), its fields carry
their :class:`~mlora_lab.spec.fields.FieldInfo` like every other, and the validator checks it on its own
(the nested kinds of :data:`~mlora_lab.spec.fields.FIELD_KINDS`). That is why they live apart from
:mod:`mlora_lab.spec.job`, which holds them (it imports this module, never the other way round): a reader of
a supervised job (a tenant's rows, its LoRA shape and optimiser; the job-wide settings) does not page past
GRPO's knobs or the service's queue, and a reader of RL or of the service finds all of it here, beside the
choices its fields take (:data:`LOSS_TYPES`, :data:`SCALE_REWARDS`). Their bounds (``MAX_REWARDS``,
``MAX_PORT``, ...) are in :mod:`mlora_lab.spec.fields`, with every other field's.

Light contract, as the spec: no torch, transformers or model code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mlora_lab.spec.fields import (
    MAX_COUNT,
    MAX_DEGREE,
    MAX_GROUP,
    MAX_NEW_TOKENS,
    MAX_PORT,
    MAX_QUEUE,
    MAX_REWARDS,
    MAX_SEED,
    MAX_SESSION_TIMEOUT,
    SpecError,
    kwargs_for,
    meta,
)

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo")
"""``RL.loss_type``: how TRL 1.16's ``GRPOTrainer`` turns per-token terms into a loss (``dapo`` its default)."""
SCALE_REWARDS = ("group", "batch", "none")
"""``RL.scale_rewards``: divide advantages by the std of the prompt's group, of the batch, or not at all."""
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
"""``RL.importance_sampling_level``: the ratio per token (GRPO), or one per sequence (GSPO)."""
IMPORTANCE_SAMPLING_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
"""``RL.importance_sampling_mode``: TRL 1.16's ``vllm_importance_sampling_mode`` (``sequence_mask`` its default)."""


PREFERENCE_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
"""``Preference.loss_type``: TRL 1.16's ``DPOTrainer`` loss types, in the order its error message lists them
(``sigmoid``: DPO). The maths of each is :mod:`mlora_lab.rl.preference`, whose own list a test keeps equal."""
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
"""``Preference.f_divergence_type``: the f-DPO divergences (``reverse_kl``: plain DPO)."""
PREFERENCE_METHODS = ("dpo", "orpo", "cpo", "kto")
"""``Preference.method``: whose trainer the tenant trains as, TRL 1.16's ``DPOTrainer``, ``ORPOTrainer``,
``CPOTrainer`` (CPO, SimPO, AlphaPO) or ``KTOTrainer`` (unpaired rows); ORPO and CPO have no reference model."""
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
"""``Preference.loss_type`` with ``method="cpo"``: ``CPOTrainer``'s (``simpo``: SimPO, with ``cpo_alpha=0``)."""
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
"""``Preference.loss_type`` with ``method="kto"``: ``KTOTrainer``'s."""
DEFAULT_LOSS_TYPES = {"dpo": "sigmoid", "orpo": "sigmoid", "cpo": "sigmoid", "kto": "kto"}
"""Each method's ``loss_type`` when it is not given (its trainer's config default)."""
METHOD_FIELDS = {
    "dpo": (
        "loss_weights",
        "label_smoothing",
        "f_divergence_type",
        "f_alpha_divergence_coef",
        "discopop_tau",
        "ld_alpha",
        "reference",
    ),
    "orpo": (),
    "cpo": ("label_smoothing", "cpo_alpha", "simpo_gamma"),
    "kto": ("reference", "desirable_weight", "undesirable_weight"),
}
"""The ``Preference`` fields each method reads besides ``method``, ``loss_type`` and ``beta`` (another set is a
mistake validation names: it would be ignored)."""
REFERENCES = ("base", "init_adapter")
"""``Preference.reference``: the base with the tenant's delta off, or the tenant's ``init_adapter`` frozen."""


def _built(cls: type, d: Any, where: str) -> Any:
    """``d`` if it is a ``cls`` already, else ``cls`` built from the dict ``d``; unknown or missing keys raise
    :class:`SpecError` (the nested parts' ``from_dict``)."""
    kwargs, problems = kwargs_for(cls, d, where)
    if problems:
        raise SpecError(problems)
    return d if isinstance(d, cls) else cls(**kwargs)


@dataclass
class RL:
    """A tenant that learns from rewards instead of fixed rows: GRPO, as TRL 1.16's ``GRPOTrainer``.

    Each optimizer step the job samples ``group_size`` completions of each of the tenant's
    ``batch_size × grad_accum`` prompts (all RL tenants in one batched generation, each row with its own
    adapter; the step then trains in ``grad_accum`` micro-batches of ``batch_size`` prompts), scores them with
    the reward functions (a weighted sum; ``None`` from a function is skipped, as TRL's ``nansum``), turns
    the rewards into advantages within each prompt's group, ``A = (r - mean) / (std + 1e-4)`` (std over the
    group with n-1, or the batch, or 1: ``scale_rewards``), and minimises the clipped importance-ratio
    loss over the completion tokens (``loss_type``), plus ``beta`` times the KL to the base model (the
    shared base with the adapter switched off). The tenant's data rows are prompts: ``{"prompt": ...}`` or
    ``{"messages": [...]}`` (the chat template with the generation prompt), and any other fields, which
    reach the reward functions as keyword arguments. See :mod:`mlora_lab.rl.rewards` for how reward
    functions are called."""

    # fmt: off
    reward: str | list[str] | None = field(default=None, metadata=meta(
        "reward", kind="rewards", section="RL", max=MAX_REWARDS, help="module:function or file.py:function"))
    """The reward function, ``"module:function"`` or ``"path/to/file.py:function"`` (a relative file is
    taken from where the job is launched), or a function itself (a notebook's ``def``, a lambda, a closure:
    pickled by value into the run directory at launch, as TRL's ``reward_funcs=[fn]``), or a list of them
    whose rewards are summed (``reward_weights``). Required, except for a tenant whose ``env`` gives its
    episodes' rewards itself. With ``env`` or ``tools`` the functions score whole conversations:
    ``completions`` are the messages after the prompt (tool calls and results included)."""
    reward_weights: list[float] | None = field(default=None, metadata=meta(
        "reward weights", kind="numbers", section="RL", optional=True, help="one per reward function"))
    """A weight per reward function (default 1 each); the tenant's reward is their weighted sum."""
    reward_names: list[str] | None = field(default=None, metadata=meta(
        "reward names", kind="texts", section="RL", optional=True, max=MAX_REWARDS,
        null_means="the functions' names", help="one per reward function: its columns' name"))
    """A name per reward function, for its columns (``rewards/<name>/mean``, ``rewards/<name>/std``); ``None``:
    each function's name (``name#2`` for a second of one name), a lambda's ``<lambda #k>`` (the tenant's k-th
    lambda). Functions given by value have theirs written here when the spec is launched."""
    group_size: int = field(default=8, metadata=meta(
        "group size", section="RL", min=2, max=MAX_GROUP, help="completions sampled per prompt"))
    """Completions per prompt (TRL's ``num_generations``): advantages compare completions of one prompt."""
    max_new_tokens: int = field(default=64, metadata=meta(
        "max new tokens", section="RL", min=1, max=MAX_NEW_TOKENS, help="longest completion"))
    """Longest completion (TRL's ``max_completion_length``); prompt and completion fit ``seq_len``."""
    temperature: float = field(default=1.0, metadata=meta(
        "temperature", kind="float", section="RL", min=0, min_open=True, max=100, help="sampling temperature"))
    """Sampling temperature (> 0: a group of greedy completions would all be the same); the training
    forward scores completions at it too (``log_softmax(logits / temperature)``, as TRL)."""
    top_p: float = field(default=1.0, metadata=meta(
        "top p", kind="float", section="RL", min=0, min_open=True, max=1, help="nucleus sampling"))
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches ``top_p``."""
    top_k: int = field(default=0, metadata=meta(
        "top k", section="RL", min=0, max=2**31 - 1, help="0: all tokens"))
    """Sample from the ``top_k`` most likely tokens only (0: no limit)."""
    stop: list[str] = field(default_factory=list, metadata=meta(
        "stop", kind="texts", section="RL", max=64, help="strings that end a completion"))
    """Strings that end a completion (besides EOS and ``max_new_tokens``); the stop string is kept."""
    loss_type: str = field(default="dapo", metadata=meta(
        "loss type", kind="choice", choices=LOSS_TYPES, section="RL", help="TRL's loss_type"))
    """How per-token terms make the loss, as TRL's ``loss_type`` (:data:`LOSS_TYPES`; ``dapo``: summed over
    every completion token of the step and divided by their number)."""
    epsilon: float = field(default=0.2, metadata=meta(
        "epsilon", kind="float", section="RL", min=0, min_open=True, max=10, help="clip the ratio to 1 ± epsilon"))
    """The importance ratio is clipped to ``[1 - epsilon, 1 + epsilon_high]``."""
    epsilon_high: float | None = field(default=None, metadata=meta(
        "epsilon high", kind="float", section="RL", min=0, min_open=True, max=100, optional=True,
        null_means="same as epsilon", help="upper clip (DAPO); null: epsilon"))
    """Upper clip of the ratio (DAPO's clip-higher); ``None``: ``epsilon``. For ``cispo`` the cap of the ratio."""
    beta: float = field(default=0.0, metadata=meta(
        "beta", kind="float", section="RL", min=0, max=100, help="KL weight to the base model"))
    """Weight of the KL to the reference, the base model without the adapter (0: no reference pass)."""
    num_iterations: int = field(default=1, metadata=meta(
        "iterations", section="RL", min=1, max=64, help="updates per generation"))
    """Optimizer steps on each generation's completions (TRL's ``num_iterations``, μ)."""
    importance_sampling_level: str = field(default="token", metadata=meta(
        "ratio level", kind="choice", choices=IMPORTANCE_SAMPLING_LEVELS, section="RL",
        help="token: GRPO; sequence: GSPO"))
    """The importance ratio ``ρ`` against the old log-probs ``ℓ_old``, per token, ``ρ_{i,t} = exp(ℓ_{i,t} −
    ℓ_old_{i,t})`` (``"token"``, GRPO), or one per sequence, the geometric mean ``ρ_i = exp(Σ_t m(ℓ − ℓ_old) /
    Σ_t m)`` (``"sequence"``, GSPO: pair it with ``loss_type="grpo"`` or ``"luspo"``), as TRL's
    ``importance_sampling_level``."""
    importance_sampling_correction: bool = field(default=False, metadata=meta(
        "IS correction", kind="bool", section="RL", help="weight the loss by trainer/sampler probabilities"))
    """Correct for the sampler's distribution differing from the trainer's (TRL's
    ``vllm_importance_sampling_correction``): each token's loss is multiplied by ``w = f(exp(ℓ_old − ℓ_s))``,
    ``ℓ_old`` the trainer's log-probs of the completions at its first step on them and ``ℓ_s`` the sampler's
    (``importance_sampling_mode`` says how). Off by default: the sampler is the trained model itself, so ``w``
    differs from 1 only where ``top_k``/``top_p`` cut its distribution, or where a generation was sampled by an
    older adapter (``max_staleness``: then the ratio ``ρ`` is against the trainer at its first step and ``w``
    weighs the staleness, AReaL's decoupled PPO)."""
    importance_sampling_mode: str = field(default="sequence_mask", metadata=meta(
        "IS mode", kind="choice", choices=IMPORTANCE_SAMPLING_MODES, section="RL",
        help="per token or sequence; truncate or mask"))
    """How ``w`` is formed from ``d = m·(ℓ_old − ℓ_s)``, with ``[C_min, C_max]`` the clip bounds:
    ``token_truncate`` ``w_{i,t} = clamp(exp(d_{i,t}), C_min, C_max)``; ``token_mask`` ``exp(d_{i,t})``, 0
    outside the bounds; ``sequence_truncate`` ``w_i = clamp(exp(Σ_t d_{i,t}), C_min, C_max)``; ``sequence_mask``
    (TRL's default) ``exp(Σ_t d_{i,t})``, 0 outside the bounds."""
    importance_sampling_clip_max: float | None = field(default=3.0, metadata=meta(
        "IS clip max", kind="float", section="RL", min=0, min_open=True, max=1000, optional=True,
        null_means="no upper bound", help="C_max of the sampling ratio"))
    """``C_max``: the sampling ratio's upper bound (TRL's ``vllm_importance_sampling_clip_max``, 3); ``None``:
    none."""
    importance_sampling_clip_min: float | None = field(default=None, metadata=meta(
        "IS clip min", kind="float", section="RL", min=0, max=1000, optional=True,
        null_means="no lower bound", help="C_min of the sampling ratio"))
    """``C_min``: the sampling ratio's lower bound (below ``C_max``); ``None``: none (TRL's default)."""
    off_policy_mask_threshold: float | None = field(default=None, metadata=meta(
        "off-policy mask", kind="float", section="RL", min=0, min_open=True, max=1000, optional=True,
        null_means="no off-policy mask", help="drop drifted sequences of negative advantage"))
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``, δ): a completion with
    ``A < 0`` whose mean ``ℓ_s − ℓ`` over its tokens exceeds δ (the policy has drifted far from what sampled
    it) carries no loss. ``None``: off."""
    scale_rewards: str = field(default="group", metadata=meta(
        "scale rewards", kind="choice", choices=SCALE_REWARDS, section="RL", help="advantage std: group/batch/none"))
    """Divide advantages by the reward std of the prompt's group, of the whole batch, or not at all."""
    mask_truncated_completions: bool = field(default=False, metadata=meta(
        "mask truncated", kind="bool", section="RL", help="no loss on completions cut at max_new_tokens"))
    """Leave completions that hit ``max_new_tokens`` without EOS or a stop string out of the loss (as TRL)."""
    reward_timeout_s: float = field(default=60.0, metadata=meta(
        "reward timeout", kind="float", section="RL", min=0, min_open=True, max=86_400,
        help="seconds a reward call may take"))
    """Seconds one call of the tenant's reward functions may take; past it the tenant is quarantined."""
    log_completions: int = field(default=2, metadata=meta(
        "log completions", section="RL", min=0, max=64, help="samples kept per logged step"))
    """Sampled completions (with their rewards) kept per logged step, shown by the dashboard."""
    max_staleness: int = field(default=0, metadata=meta(
        "max staleness", section="RL", min=0, max=64,
        help="optimizer steps a generation may be sampled ahead"))
    """How many optimizer steps before its first training step a generation may be sampled (TRL AsyncGRPO's
    ``max_staleness``). ``0``: sampled when its window starts (on-policy, as TRL's ``GRPOTrainer``). ``s > 0``:
    the tenant samples its next generations up to ``s`` steps ahead, with the adapter of that time, and their
    rewards compute while it and the other tenants train; the ratio is then against the sampler's log-probs
    (``π_θ / π_sampler``, clipped) and each completion row records the adapter version that sampled it.
    Single-turn tenants only, for now."""
    env: Any = field(default=None, metadata=meta(
        "env", kind="function", section="Agent", optional=True, form=False,
        help="rollout(client, model, example): an agent's episode"))
    """An agent environment: ``rollout(client, model, example, **env_args)`` (``"module:function"``,
    ``"file.py:function"`` or the function itself, pickled at launch as reward functions are), which plays one
    episode of ``example`` (a data row) through ``client``, an ``openai.OpenAI`` client of the job's own endpoint
    (``openai.AsyncOpenAI`` for an ``async def``), calling ``model`` (the tenant) as many turns as it likes, and
    returns the episode's reward (a number, or ``{"reward", "rewards": {name: score}, "metrics", "messages"}``).
    Or a ``verifiers`` 0.4 environment: ``"verifiers:<taskset id>"``, an environment module's loader
    (``"my_env:load_environment"``: a function that takes only ``env_args`` and returns a ``verifiers.v1`` ``Env`` or
    ``Taskset``), or such an object itself; its episodes run through ``Env.run_episode`` with an in-process harness
    (:mod:`mlora_lab.agents.vf_harness`). The tokens trained on are the ones the endpoint sampled for the episode
    (:mod:`mlora_lab.agents`)."""
    env_args: dict[str, Any] = field(default_factory=dict, metadata=meta(
        "env args", kind="mapping", section="Agent", form=False, help="keyword arguments of env"))
    """Keyword arguments the ``env`` function is called with besides its three (JSON values); a verifiers loader's
    arguments, or a verifiers taskset's config fields."""
    tools: list[Any] = field(default_factory=list, metadata=meta(
        "tools", kind="functions", section="Agent", form=False, max=MAX_REWARDS,
        help="functions the model may call"))
    """Tools the model may call (TRL's ``tools=``): functions with type hints and a Google-style docstring
    (their JSON schemas go to the chat template's ``tools``), each ``"module:function"``, ``"file.py:function"``
    or the function itself. Without ``env``, the job plays the tool loop itself (TRL's): the model answers,
    each tool call it makes is run and its result appended, for up to ``max_turns`` turns, and the reward
    functions score the whole conversation."""
    max_turns: int = field(default=8, metadata=meta(
        "max turns", section="Agent", min=1, max=256, help="model turns per episode (tools)"))
    """The most model turns of one episode of the built-in tool loop (``tools`` without ``env``)."""
    turn_timeout_s: float = field(default=60.0, metadata=meta(
        "turn timeout", kind="float", section="Agent", min=0, min_open=True, max=86_400,
        help="seconds a tool call may take"))
    """Seconds a tool call (or the env's wait for one model turn) may take; past it the tenant is quarantined."""
    rollout_timeout_s: float = field(default=600.0, metadata=meta(
        "rollout timeout", kind="float", section="Agent", min=0, min_open=True, max=86_400,
        help="seconds one generation's episodes may take"))
    """Seconds the episodes of one generation may take in all; past it the tenant is quarantined."""
    harness: bool = field(default=False, metadata=meta(
        "harness", kind="bool", section="Agent", form=False,
        help="episodes played by an outside agent program"))
    """Harness mode: any agent program (openai-agents, smolagents, a shell script with ``curl``) plays the
    tenant's episodes. Each generation's ``B·k·G`` episodes (``G`` of each data row, trajectory ids
    ``<tenant>/<generation>/<b>/<j>``) are published at the job's endpoint; with the tenant's key (the run's
    ``agents.json``, ``run.agent_endpoint(tenant)``) the program, any number of times at once::

        GET  <base_url>/episodes?limit=N&wait=S        claims up to N episodes: {"data": [{"trajectory_id",
                                                       "example"}]} (a long poll of up to S seconds)
        POST <base_url>/chat/completions                model=<tenant>, header X-Trajectory-Id: <id>; as
                                                        many turns as it likes
        POST <base_url>/trajectories/<id>/reward        {"reward": x} or {"rewards": {name: score}, "metrics":
                                                        {...}}, once (as an ``env`` rollout returns)

    The generation trains once every episode has its reward; past ``rollout_timeout_s`` from publishing the
    tenant fails, with the reason. No ``env`` and no ``tools``; reward functions are optional (they score each
    conversation, as for ``tools``)."""
    # fmt: on

    @property
    def rewards(self) -> list[Any]:
        """``reward`` as a list (references, or functions held in memory until the spec is launched); ``[]``
        for an ``env`` tenant without reward functions."""
        if self.reward is None:
            return []
        return list(self.reward) if isinstance(self.reward, list | tuple) else [self.reward]

    @property
    def agent(self) -> bool:
        """Whether the tenant plays episodes (``env``, ``tools`` or ``harness``) rather than one completion per
        prompt."""
        return self.env is not None or bool(self.tools) or self.harness is True

    @property
    def own_reward(self) -> bool:
        """Whether each episode comes with a reward of its own (an ``env``'s, or a ``harness`` program's):
        the ``"env"`` reward column."""
        return self.env is not None or self.harness is True

    @property
    def functions(self) -> list[tuple[str, int, Any]]:
        """Every function the tenant names, ``(role, index, value)``: ``("", i, reward i)``, ``("env", 0, env)``,
        ``("tool", k, tool k)``; what a launch pickles and a path resolves."""
        out = [("", i, r) for i, r in enumerate(self.rewards)]
        out += [("env", 0, self.env)] if self.env is not None else []
        return out + [("tool", k, f) for k, f in enumerate(self.tools)]

    def with_functions(self, functions: list[tuple[str, int, Any]]) -> RL:
        """A copy with :attr:`functions` replaced (same roles and order; rewards keep their list-or-one shape)."""
        rewards = [v for role, _, v in functions if role == ""]
        env = [v for role, _, v in functions if role == "env"]
        tools = [v for role, _, v in functions if role == "tool"]
        reward = rewards if isinstance(self.reward, list | tuple) else (rewards[0] if rewards else None)
        return dataclasses.replace(self, reward=reward, env=env[0] if env else None, tools=tools)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | RL) -> RL:
        """Build from a dict (``rl`` of a tenant in ``job.json``); unknown or missing keys raise
        ``SpecError``."""
        return _built(cls, d, "rl")


@dataclass
class Preference:
    """A tenant that learns from preference pairs instead of rows to imitate: DPO and its family, as TRL 1.16's
    ``DPOTrainer`` computes them (the same names and defaults as its ``DPOConfig``), or ORPO and CPO/SimPO
    (``method``), as its ``ORPOTrainer`` and ``CPOTrainer`` do, which need no reference.

    The tenant's data rows are pairs in TRL's formats: ``{"prompt", "chosen", "rejected"}`` (texts, or
    conversations as lists of messages) or ``{"chosen", "rejected"}`` (the prompt is their common start). For
    each pair the loss compares the log-ratios ``u = log π(y|x) − log π_ref(y|x)`` of the chosen and the rejected
    completion (``sigmoid``: ``−log σ(β(u_w − u_l))``). The reference ``π_ref`` is the shared base with the
    tenant's delta off (``reference="base"``, TRL's PEFT case: no second model) or the tenant's
    ``init_adapter`` frozen (``"init_adapter"``, TRL's ``ref_adapter_name``); each pair's reference log-probs
    are computed once, the first time the pair is drawn, and kept (TRL's ``precompute_ref_log_probs``).
    A pair counts as one row of ``batch_size``: a micro-batch holds ``batch_size`` pairs, ``2·batch_size``
    sequences. Every sequence (prompt + completion) is cut to the job's ``seq_len``, keeping its start; a
    pair whose prompt alone fills ``seq_len`` is dropped, as TRL drops it."""

    # fmt: off
    method: str = field(default="dpo", metadata=meta(
        "method", kind="choice", choices=PREFERENCE_METHODS, section="Preference",
        help="dpo (a reference), orpo or cpo (none)"))
    """Whose loss: ``"dpo"`` (``DPOTrainer``: the log-ratios to a reference), ``"orpo"`` (``ORPOTrainer``: the
    chosen answer's NLL over prompt and completion, minus ``β`` times the log-sigmoid of the log odds ratio of the
    completions' average log-probs), ``"cpo"`` (``CPOTrainer``: ``loss_type`` sigmoid, hinge, ipo or simpo on
    the completions' log-probs, plus ``cpo_alpha`` times the chosen completion's NLL) or ``"kto"``
    (``KTOTrainer``: unpaired rows ``{"prompt", "completion", "label"}``, or pairs it unpairs, each row's
    log-ratio against the reference and a KL estimate from mismatched completions). See
    :mod:`mlora_lab.rl.preference` and :mod:`mlora_lab.rl.preference_free` for the maths."""
    loss_type: str | list[str] | None = field(default=None, metadata=meta(
        "loss type", kind="texts", section="Preference", max=len(PREFERENCE_LOSS_TYPES), optional=True,
        null_means="the method's default", help="TRL's loss_type: sigmoid (DPO), ipo, hinge, robust, ..."))
    """DPO: one of :data:`PREFERENCE_LOSS_TYPES`, or a list of them whose losses are summed (``loss_weights``):
    RPO (TRL's former ``rpo_alpha = α``) is ``["sigmoid", "sft"]`` with weights ``[1, α]``. CPO: one of
    :data:`CPO_LOSS_TYPES`; KTO: one of :data:`KTO_LOSS_TYPES`. ORPO has one loss. ``None``: the method's
    trainer's default (:data:`DEFAULT_LOSS_TYPES`: ``sigmoid``, ``kto`` for KTO)."""
    loss_weights: list[float] | None = field(default=None, metadata=meta(
        "loss weights", kind="numbers", section="Preference", optional=True, max=len(PREFERENCE_LOSS_TYPES),
        help="one per loss type (default 1 each)"))
    """A weight per loss type (default 1 each)."""
    beta: float = field(default=0.1, metadata=meta(
        "beta", kind="float", section="Preference", min=0, min_open=True, max=1000,
        help="how far from the reference the tenant may move"))
    """The inverse temperature ``β`` of the log-ratios (smaller: further from the reference); ``rewards/*``
    are ``β·u``. ORPO: the weight ``λ`` of its odds-ratio term (``ORPOConfig.beta``)."""
    label_smoothing: float = field(default=0.0, metadata=meta(
        "label smoothing", kind="float", section="Preference", min=0, max=0.5, max_open=True,
        help="assumed share of flipped labels (robust, exo_pair, aot)"))
    """The share of pairs assumed flipped (cDPO/robust DPO; ``exo_pair``'s ``ε``, which must be > 0)."""
    f_divergence_type: str = field(default="reverse_kl", metadata=meta(
        "f-divergence", kind="choice", choices=F_DIVERGENCES, section="Preference",
        help="f-DPO's divergence (reverse_kl: DPO)"))
    """The divergence to the reference (f-DPO); a non-default one applies to the sigmoid family only."""
    f_alpha_divergence_coef: float = field(default=0.5, metadata=meta(
        "f alpha", kind="float", section="Preference", min=-100, max=100,
        help="alpha of alpha_divergence"))
    """``α`` of ``alpha_divergence``."""
    discopop_tau: float = field(default=0.05, metadata=meta(
        "discopop tau", kind="float", section="Preference", min=0, min_open=True, max=100,
        help="discopop's temperature"))
    """The temperature ``τ`` of the ``discopop`` loss."""
    ld_alpha: float | None = field(default=None, metadata=meta(
        "ld alpha", kind="float", section="Preference", min=0, max=1, optional=True,
        null_means="no length desensitisation", help="LD-DPO: weight of the longer answer's extra tokens"))
    """LD-DPO: the tokens a completion has beyond the pair's shorter one count by this weight (``None``: fully)."""
    reference: str | None = field(default=None, metadata=meta(
        "reference", kind="choice", choices=REFERENCES, section="Preference", optional=True,
        null_means="as TRL: init_adapter if any, else base",
        help="base: the base without the adapter; init_adapter: the adapter it starts from"))
    """The reference model: ``"base"`` (the shared base, the delta off) or ``"init_adapter"`` (the tenant's
    ``init_adapter``, frozen as it was before the first step). ``None``: what TRL 1.16 does, the init adapter
    when the tenant has one (TRL copies a pretrained adapter as its ``"ref"`` adapter), else the base. DPO only."""
    cpo_alpha: float = field(default=1.0, metadata=meta(
        "cpo alpha", kind="float", section="Preference", min=0, max=1000,
        help="CPO: weight of the chosen answer's NLL (0 for SimPO)"))
    """CPO: the weight of the chosen completion's NLL term (``CPOConfig.cpo_alpha``; 0 for SimPO)."""
    simpo_gamma: float = field(default=0.5, metadata=meta(
        "simpo gamma", kind="float", section="Preference", min=-1000, max=1000,
        help="SimPO's target reward margin"))
    """CPO with ``loss_type="simpo"``: the target reward margin ``γ`` (``CPOConfig.simpo_gamma``)."""
    desirable_weight: float = field(default=1.0, metadata=meta(
        "desirable weight", kind="float", section="Preference", min=0, max=1000,
        help="KTO: weight of the desirable rows' losses"))
    """KTO: the weight ``λ_D`` of the desirable rows' losses (``KTOConfig.desirable_weight``)."""
    undesirable_weight: float = field(default=1.0, metadata=meta(
        "undesirable weight", kind="float", section="Preference", min=0, max=1000,
        help="KTO: weight of the undesirable rows' losses"))
    """KTO: the weight ``λ_U`` of the undesirable rows' losses (``KTOConfig.undesirable_weight``)."""
    # fmt: on

    def reference_of(self, init_adapter: str | None) -> str:
        """The reference a tenant with this ``init_adapter`` trains against (``reference``, or its default)."""
        if self.reference is not None:
            return self.reference
        return "init_adapter" if init_adapter is not None else "base"

    @property
    def loss_types(self) -> list[str]:
        """``loss_type`` as a list (the method's default when it is ``None``)."""
        if self.loss_type is None:
            return [DEFAULT_LOSS_TYPES.get(self.method, "sigmoid")]
        return list(self.loss_type) if isinstance(self.loss_type, list | tuple) else [self.loss_type]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Preference) -> Preference:
        """Build from a dict (``pref`` of a tenant in ``job.json``); unknown keys raise ``SpecError``."""
        return _built(cls, d, "pref")


@dataclass
class ClientModel:
    """The Tinker model (a training client's LoRA) behind a served job's tenant: its id, the API key that made
    it, and its ``LoraConfig``. The job writes it into ``job.json`` when the client creates the model; a resume
    registers the model again under its id and owner (its saved states stay reachable), and its client has
    ``Service.session_timeout`` to come back before the tenant is saved and paused."""

    # fmt: off
    model_id: str = field(metadata=meta("model id", kind="text", section="Service", max=255,
                                         help="the Tinker model id"))
    owner: str = field(metadata=meta("owner", kind="text", section="Service", max=255,
                                      help="the name of the API key that made it"))
    seed: int | None = field(default=None, metadata=meta(
        "seed", section="Service", min=0, max=MAX_SEED, optional=True, help="its LoRA init seed"))
    train_attn: bool = field(default=True, metadata=meta("train attn", kind="bool", section="Service"))
    train_mlp: bool = field(default=True, metadata=meta("train mlp", kind="bool", section="Service"))
    train_unembed: bool = field(default=True, metadata=meta("train unembed", kind="bool", section="Service"))
    # fmt: on

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | ClientModel) -> ClientModel:
        """Build from a dict (``client`` of a tenant in ``job.json``); unknown or missing keys raise
        ``SpecError``."""
        return _built(cls, d, "client")


@dataclass
class Parallel:
    """How the job is laid out over processes: ``fsdp * tp`` must divide ``world_size``, and ``ep``
    the ``world_size / tp`` data-parallel ranks (expert parallelism borrows from them)."""

    # fmt: off
    nproc: int = field(default=1, metadata=meta(
        "nproc", section="Parallel", min=1, max=MAX_DEGREE, slider=True,
        help="processes (ranks) on this machine"))
    """Processes (ranks) per node."""
    nnodes: int = field(default=1, metadata=meta(
        "nnodes", section="Parallel", min=1, max=MAX_DEGREE, form=False))
    """Nodes."""
    fsdp: int = field(default=1, metadata=meta(
        "fsdp", section="Parallel", min=1, max=MAX_DEGREE, help="shard group size: a divisor of nproc / tp"))
    """FSDP2 shard-group size (data parallel over the rest)."""
    tp: int = field(default=1, metadata=meta(
        "tp", section="Parallel", min=1, max=MAX_DEGREE,
        help="tensor parallel: ranks that split every projection"))
    """Tensor-parallel degree."""
    ep: int = field(default=1, metadata=meta(
        "ep", section="Parallel", min=1, max=MAX_DEGREE,
        help="expert parallel (MoE): a divisor of nproc / tp and of the experts"))
    """Expert-parallel degree (MoE models): groups of ``ep`` data-parallel ranks split the experts."""
    rollout_ranks: int = field(default=0, metadata=meta(
        "rollout ranks", section="Parallel", min=0, max=MAX_DEGREE,
        help="processes that only sample for RL tenants (the last ones)"))
    """Processes, of ``nproc * nnodes``, that hold the frozen base and every RL tenant's adapter and do the RL
    tenants' sampling while the others train (the last ranks; ``fsdp``, ``tp`` and ``ep`` lay out the others).
    After each optimizer step a tenant's adapter reaches them in memory, over the job's process group. ``0``:
    the training ranks sample, between steps. Applies to a job under torchrun; a job in the notebook's own
    process samples in place."""
    # fmt: on

    @property
    def world_size(self) -> int:
        """Total number of ranks: ``nproc * nnodes``."""
        return self.nproc * self.nnodes

    @property
    def trainers(self) -> int:
        """The ranks that train: ``world_size − rollout_ranks``."""
        return self.world_size - self.rollout_ranks

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Parallel) -> Parallel:
        """Build from a dict; unknown keys raise ``SpecError`` (and any input gives a ``Parallel`` or
        ``SpecError``)."""
        kwargs, problems = kwargs_for(cls, d, "parallel")
        if problems:
            raise SpecError(problems)
        return d if isinstance(d, Parallel) else cls(**kwargs)


@dataclass
class Service:
    """The job also serves the Tinker API (:mod:`mlora_lab.service`): programs drive their own tenants with
    the official ``tinker`` SDK, request by request, and the requests of every client that wait at the same
    moment share one mixed-tenant step. Rank 0 serves HTTP on a thread; every request needs an API key
    (``<run_dir>/service/keys.json``, owner-only). The job stays up until it is stopped (as ``serve``).
    A client's ``train_attn``/``train_mlp``/``train_unembed`` pick among the job's ``slot_modules``; on an
    MoE model every packed expert parameter also gets slots, which ``train_mlp`` adapts."""

    # fmt: off
    host: str = field(default="127.0.0.1", metadata=meta(
        "host", kind="text", section="Service", max=255, help="address to listen on (loopback by default)"))
    """The address the server listens on: loopback unless told otherwise (``"0.0.0.0"``: every interface)."""
    port: int = field(default=0, metadata=meta(
        "port", section="Service", min=0, max=MAX_PORT, help="0: any free port"))
    """The TCP port; 0 = a free one, chosen when the server starts (``service/endpoint.json`` says which)."""
    lora_alpha: float = field(default=32.0, metadata=meta(
        "lora alpha", kind="float", section="Service", min=0, min_open=True,
        help="alpha of the clients' adapters (Tinker has none)"))
    """LoRA alpha of every client's adapter: Tinker's ``LoraConfig`` has a rank and no alpha."""
    max_queue: int = field(default=4096, metadata=meta(
        "max queue", section="Service", min=1, max=MAX_QUEUE, help="waiting requests; more are answered 429"))
    """Requests that may wait at once; past it a request is answered 429 (the SDK retries it). One source (a
    model's numbered requests, or one key's samples) holds at most a quarter of them."""
    session_timeout: float = field(default=60.0, metadata=meta(
        "session timeout", kind="float", section="Service", min=1, max=MAX_SESSION_TIMEOUT,
        help="seconds without heartbeat before a client's tenants are saved and paused"))
    """Seconds a client may be silent (no heartbeat nor request; the SDK heartbeats every 10 s) before its
    tenants are saved and paused; a request of its brings them back."""
    max_step_tokens: int | None = field(default=None, metadata=meta(
        "max step tokens", section="Service", min=1, max=MAX_COUNT, optional=True, null_means="no limit",
        help="datum tokens one step takes at most; more wait for the next"))
    """The input tokens of the clients' datums one step of the loop takes at most: the forward/backward
    requests waiting beyond it run in the next steps (each model's in order, the models taking turns to go
    first; one request larger than it runs alone). A step's activation memory grows with its tokens, so this
    bounds it however many clients send at once; on a CPU a smaller step also costs less per token (its
    working set stays in cache), while a GPU gains from big steps. ``None``: every waiting request."""
    model_name: str | None = field(default=None, metadata=meta(
        "model name", kind="text", section="Service", optional=True, max=256,
        help="the base's name to clients; empty: its Hub id, or its path"))
    """The name clients give the base (``create_lora_training_client(base_model=...)``, what
    ``get_server_capabilities`` lists and ``get_info`` answers): ``None`` = ``base_model`` (its Hub id, by
    which the SDK's and the cookbook's tokenizer and renderer lookups find the model). The tokenizer clients are
    told to load is the spec's ``tokenizer`` or the base's Hub id, else the base's local directory."""
    # fmt: on

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Service) -> Service:
        """Build from a dict (``service`` of ``job.json``); unknown keys raise ``SpecError``."""
        kwargs, problems = kwargs_for(cls, d, "service")
        if problems:
            raise SpecError(problems)
        return d if isinstance(d, Service) else cls(**kwargs)


@dataclass
class Eval:
    """An evaluation the job runs while it trains (``JobSpec.evals``): every ``every`` global steps, and once
    when training ends, the base and the tenants complete ``data``'s prompts in ONE batched generation
    between two steps (each row with its own adapter, as :func:`mlora_lab.evaluate` does after training);
    ``metrics`` score them, and each model's mean per metric (with its bootstrap 95 % interval) is logged as
    a row ``eval/<name>/<metric>``, which the dashboard, ``ml.compare`` and ``ml.summary`` read. The latest
    completions and scores are kept in ``<run>/evals/<name>/`` (the evaluation's table)."""

    # fmt: off
    name: str = field(metadata=meta(
        "name", kind="name", section="Eval", help="letters, digits, . _ - (it names a folder)"))
    """Its name: the rows' ``eval/<name>/<metric>`` and its folder ``evals/<name>/``."""
    data: Any = field(metadata=meta(
        "data", kind="path", section="Eval", help="prompt rows: prompt or messages, and other columns"))
    """Its examples: any tenant data source (a file, a DataFrame, rows, ``ml.HubDataset``; one held in memory
    is written into the run at launch) whose rows hold ``prompt`` or ``messages`` and any other columns."""
    metrics: list[Any] = field(metadata=meta(
        "metrics", kind="rewards", section="Eval", max=MAX_REWARDS, help="built-in names, module:function"))
    """Built-in metric names (``exact_match``, ``contains``, ``regex``, ``numeric_match``, ``rouge``),
    ``"module:function"``, ``"file.py:function"`` or functions (pickled into the run at launch): TRL's reward
    signature, as :mod:`mlora_lab.evals.metrics` describes."""
    every: int = field(default=0, metadata=meta(
        "every", section="Eval", min=0, max=MAX_COUNT, help="global steps between runs; 0: at the end only"))
    """Run it every ``every`` global steps (0: only once training ends); it always runs at the end."""
    models: list[str] | None = field(default=None, metadata=meta(
        "models", kind="texts", section="Eval", optional=True, max=MAX_REWARDS * 64,
        help="base and tenants' names; null: all"))
    """Which models: ``"base"`` and tenants' names (``None``: the base and every tenant training then). A
    tenant's own evaluation is ``models=["base", "alice"]``."""
    max_new_tokens: int = field(default=64, metadata=meta(
        "max new tokens", section="Eval", min=1, max=MAX_NEW_TOKENS, help="longest completion"))
    num_samples: int = field(default=1, metadata=meta(
        "samples", section="Eval", min=1, max=MAX_GROUP, help="completions per prompt and model (pass@k)"))
    temperature: float = field(default=0.0, metadata=meta(
        "temperature", kind="float", section="Eval", min=0, max=100, help="0: greedy"))
    top_p: float = field(default=1.0, metadata=meta(
        "top p", kind="float", section="Eval", min=0, min_open=True, max=1, help="nucleus sampling"))
    limit: int | None = field(default=None, metadata=meta(
        "limit", section="Eval", min=1, max=MAX_COUNT, optional=True, null_means="every row",
        help="the first rows only"))
    timeout_s: float = field(default=60.0, metadata=meta(
        "timeout", kind="float", section="Eval", min=0, min_open=True, max=86_400,
        help="seconds the metrics may take"))
    # fmt: on

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (its ``data`` a path or a Hub dataset's dict, as a tenant's)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if hasattr(d["data"], "to_dict"):
            d["data"] = d["data"].to_dict()
        d["metrics"] = list(self.metrics)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Eval) -> Eval:
        """Build from a dict (one of ``evals`` in ``job.json``); unknown or missing keys raise ``SpecError``."""
        if isinstance(d, dict) and isinstance(d.get("data"), dict):
            from mlora_lab.sources import HubDataset

            d = {**d, "data": _built(HubDataset, d["data"], "eval data (a Hub dataset)")}
        return _built(cls, d, "evals")
