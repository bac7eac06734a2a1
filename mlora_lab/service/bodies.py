"""The JSON requests of the Tinker protocol, checked, and what the training loop gets from them.

Each ``read_*`` function takes a decoded JSON body and returns the checked request as a small dataclass
(the :attr:`~.work.Work.body` the training loop reads), or raises :class:`BodyError` naming every problem
at once. Ownership (which key may reach which session, model or checkpoint) is :mod:`.app`'s business;
these functions check only shapes, types and ranges. Unknown fields are ignored, so a newer SDK that adds
one still works.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from mlora_lab.rundir.service import checkpoint_name_problem, split_tinker_path

CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler"}
MAX_NUM_SAMPLES = 16
MAX_STOP = 32
MAX_PROMPT_CHUNKS = 1024
"""Chunks of one prompt at most (more are refused, never dropped)."""
MIN_TEMPERATURE = 1e-5
"""A temperature in ``(0, MIN_TEMPERATURE)`` samples greedily, as ``0`` does (vLLM's ``_SAMPLING_EPS``):
dividing the logits by less overflows them (``1e-320`` makes every logit infinite)."""
MIN_TOP_P = 1e-6
"""A ``top_p`` in ``(0, MIN_TOP_P)`` is taken as ``MIN_TOP_P``: the most likely token alone (its
probability is at least ``1 / vocabulary``, so this holds for a vocabulary of up to 10**6). Below it the
float32 the sampler filters in rounds it to 0, which would keep no token at all."""


def floored_temperature(temperature: float) -> float:
    """``temperature`` as the sampler takes it: one in ``(0, MIN_TEMPERATURE)`` is 0 (greedy). Both routes
    (the Tinker ``asample`` and the OpenAI completions) sample through it."""
    return 0.0 if 0 < temperature < MIN_TEMPERATURE else temperature


def prompt_room_problem(prompt_tokens: int, max_context: int, sampled: bool = True) -> str | None:
    """Why a prompt of ``prompt_tokens`` tokens does not fit a job whose context holds ``max_context``
    (``sampled``: with at least one token to sample after it), saying how long a prompt may be; None when it
    fits."""
    most = max_context - 1 if sampled else max_context
    if prompt_tokens <= most:
        return None
    room = " leave room to sample" if sampled else " fit the job's context"
    return (
        f"the prompt has {prompt_tokens} tokens; at most {most}{room} (the job's context holds {max_context})"
    )


class BodyError(ValueError):
    """A request body that cannot be used: every problem found (a user error). ``status``: 422 for fields
    of the wrong type or range, 400 when a checkpoint name or path is not one (a name that is a path, say:
    a request that is malformed, not merely out of range)."""

    def __init__(self, problems: list[str], status: int = 422) -> None:
        self.problems = list(problems)
        self.status = status
        super().__init__("; ".join(self.problems))


@dataclass
class ModelInfo:
    """A LoRA training model (a tenant of the job), as created by ``create_model``."""

    model_id: str
    owner: str
    base_model: str
    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    name: str | None = None
    """What the client would call it (``user_metadata["name"]`` of the model or its session): the tenant's
    name, made safe and unique by the job; None: the key's name and a count (``alice-1``)."""


@dataclass(frozen=True)
class AdamStep:
    """``optim_step``'s ``AdamParams``: torch AdamW with decoupled weight decay; clip 0 = none."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class Save:
    """``save_weights`` (``kind="state"``: adapter + optimiser) or ``save_weights_for_sampler``
    (``kind="sampler"``): either ``name`` is given, or ``sampling_session_id`` (a snapshot with no name
    whose sampling session the future's result names)."""

    kind: str
    name: str | None
    sampling_session_id: str | None = None
    overwrite: bool = False
    ttl_seconds: int | None = None
    inflight: bool = False
    """``kind="inflight"`` (a sampler save): the model's shared, mutable sampling target, which every later
    inflight save updates for its existing clients too; else a frozen snapshot."""


@dataclass(frozen=True)
class Load:
    """``load_weights``: into an existing model, or (``create``) a new model ``model_id`` from a state."""

    path: str
    optimizer: bool
    create: bool = False
    owner: str = ""
    name: str | None = None
    """A new model's ``user_metadata["name"]`` (see :attr:`ModelInfo.name`)."""


@dataclass(frozen=True)
class Sample:
    """``asample``: one prompt, ``num_samples`` completions of it."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_at_eos: bool = True
    """``stop`` absent keeps the model's end-of-sequence stop; ``stop: []`` turns every stop off."""
    prompt_logprobs: bool = False
    sampling_session_id: str | None = None
    model_path: str | None = None
    """The ``tinker://…/sampler_weights/…`` snapshot to sample from; None: the base model."""
    sequence_ids: list[str] = field(default_factory=list)
    tenant: str | None = None
    """A tenant of the job sampled with its current adapter (the OpenAI endpoint's ``model``); None: the
    snapshot or the base."""
    top_logprobs: int = 0
    """The most likely tokens to give at each step (the OpenAI endpoint's ``top_logprobs``)."""
    json_reply: bool = False
    """Answer with JSON (tokens, logprobs, top logprobs, stop reasons: the OpenAI endpoint) rather than the
    SDK's protobuf."""


@dataclass(frozen=True)
class CheckpointPath:
    """A parsed ``tinker://<training_run_id>/<weights|sampler_weights>/<name>``."""

    run_id: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


def parse_checkpoint_path(path: Any, where: str, f: Fields) -> CheckpointPath | None:
    """The checkpoint ``path`` (field ``where`` of ``f``'s body), or None with the problem added to ``f``
    (a 400: :func:`~mlora_lab.rundir.service.split_tinker_path` says what is wrong)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        f.bad(f"{where} must be a tinker:// path, got {_show(path)}")
        return None
    try:
        return CheckpointPath(*split_tinker_path(path))
    except ValueError as e:
        f.bad(f"{where}: {e}")
        return None


class Fields:
    """Reads typed fields of a JSON object, collecting a problem for each one that is missing or wrong."""

    def __init__(self, body: Any, where: str = "") -> None:
        self.problems: list[str] = []
        self.where = where
        if not isinstance(body, dict):
            self.problems.append(f"{where or 'the body'} must be a JSON object, got {_show(body)}")
            body = {}
        self.body: dict[str, Any] = body
        self.status = 422

    def bad(self, problem: str) -> None:
        """A problem that makes the request malformed (HTTP 400), not merely out of range (422)."""
        self.problems.append(problem)
        self.status = 400

    def checkpoint_name(self, key: str, required: bool = True) -> str | None:
        """The checkpoint name in ``key`` (:data:`~mlora_lab.rundir.service.CHECKPOINT_NAME`): a name,
        never a path; a 400 naming the field otherwise."""
        value = self._get(key, required)
        if value is None:
            return None
        why = checkpoint_name_problem(value)
        if why is not None:
            self.bad(f"{self._name(key)} {_show(value)} is not a checkpoint name: {why}")
            return None
        return value

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str, required: bool) -> Any:
        value = self.body.get(key)
        if value is None and required:
            self.problems.append(f"{self._name(key)} is missing")
        return value

    def str(self, key: str, required: bool = True, pattern: re.Pattern | None = None) -> str | None:
        value = self._get(key, required)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            self.problems.append(f"{self._name(key)} must be a non-empty string, got {_show(value)}")
            return None
        if pattern is not None and not pattern.fullmatch(value):
            self.problems.append(f"{self._name(key)} {value!r} must match {pattern.pattern}")
            return None
        if "/" in value and pattern is None and key.endswith("_id"):
            self.problems.append(f"{self._name(key)} {value!r} must not contain '/'")
            return None
        return value

    def int(
        self,
        key: str,
        lo: int | None = None,
        hi: int | None = None,
        required: bool = True,
        default: int | None = None,
    ) -> int | None:
        value = self._get(key, required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{self._name(key)} must be an integer, got {_show(value)}")
            return default
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            self.problems.append(f"{self._name(key)} is {value}; it must be in [{lo}, {hi}]")
            return default
        return value

    def float(
        self,
        key: str,
        default: float | None = None,
        required: bool = False,
        *,
        gt: float | None = None,
        ge: float | None = None,
        lt: float | None = None,
        le: float | None = None,
    ) -> float | None:
        value = self._get(key, required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.problems.append(f"{self._name(key)} must be a finite number, got {_show(value)}")
            return default
        value = float(value)
        bounds = [
            (gt, lambda b: value > b, ">"),
            (ge, lambda b: value >= b, ">="),
            (lt, lambda b: value < b, "<"),
            (le, lambda b: value <= b, "<="),
        ]
        for bound, ok, sign in bounds:
            if bound is not None and not ok(bound):
                self.problems.append(f"{self._name(key)} is {value}; it must be {sign} {bound}")
                return default
        return value

    def bool(self, key: str, default: bool | None = None, required: bool = False) -> bool | None:
        value = self._get(key, required)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.problems.append(f"{self._name(key)} must be true or false, got {_show(value)}")
            return default
        return value

    def raise_if_any(self, *more: Fields) -> None:
        """One :class:`BodyError` naming the problems of this body and of ``more`` (its nested objects'),
        400 if any of them makes the request malformed."""
        problems = self.problems + [p for f in more for p in f.problems]
        if problems:
            raise BodyError(problems, 400 if any(f.status == 400 for f in (self, *more)) else 422)


MAX_METADATA_ITEMS = 64


def read_user_metadata(f: Fields, key: str = "user_metadata") -> dict[str, str]:
    """``f.body[key]``: an object of at most :data:`MAX_METADATA_ITEMS` text items (each at most 1,000
    characters; the SDK types it ``dict[str, str]``, and numbers are taken as their text), or ``{}``."""
    value = f.body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_ITEMS:
        f.problems.append(
            f"{key} must be an object of at most {MAX_METADATA_ITEMS} items, got {_show(value)}"
        )
        return {}
    out = {}
    for k, v in value.items():
        if (
            isinstance(v, bool)
            or not isinstance(v, str | int | float)
            or len(str(k)) > 1000
            or len(str(v)) > 1000
        ):
            f.problems.append(f"{key}[{_show(k)}] must be a text of at most 1,000 characters, got {_show(v)}")
            continue
        out[str(k)] = str(v)
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_create_model(body: Any, *, owner: str, base_model: str, max_rank: int) -> tuple[str, int, ModelInfo]:
    """``(session_id, model_seq_id, the model)`` of a ``create_model`` body."""
    f = Fields(body)
    session_id = f.str("session_id")
    model_seq_id = f.int("model_seq_id", 0, 2**31 - 1)
    asked = f.str("base_model")
    if asked is not None and asked != base_model:
        f.problems.append(f"base_model {asked!r} is not served here; this service trains {base_model!r}")
    lora = Fields(f.body.get("lora_config", {}), "lora_config")
    rank = lora.int("rank", 1, max_rank)
    seed = lora.int("seed", required=False)
    train = {k: lora.bool(k, True) for k in ("train_attn", "train_mlp", "train_unembed")}
    if not any(v for v in train.values() if v is not None) and not lora.problems:
        lora.problems.append("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
    meta = read_user_metadata(f)
    optimizer = f.body.get("optimizer_config")
    if optimizer is not None:
        kind = optimizer.get("type") if isinstance(optimizer, dict) else optimizer
        if kind != "adamw":
            f.problems.append(f"optimizer_config type {_show(kind)} is not supported; only 'adamw'")
    f.raise_if_any(lora)
    model_id = f"{session_id}:train:{model_seq_id}"
    info = ModelInfo(model_id, owner, base_model, rank, seed, **train, name=meta.get("name"))  # type: ignore[arg-type]
    return session_id, model_seq_id, info  # type: ignore[return-value]


def read_adam(body: Any) -> tuple[str, int, AdamStep]:
    """``(model_id, seq_id, the step)`` of an ``optim_step`` body."""
    f = Fields(body)
    model_id = f.str("model_id")
    seq_id = f.int("seq_id", 1, 2**31 - 1)
    params = next(
        (f.body[k] for k in ("adam_params", "optim_params", "optimizer_params") if k in f.body), None
    )
    family = params.get("type") if isinstance(params, dict) else None
    if params is None:
        f.problems.append("adam_params is missing")
    elif "optimizer_params" in f.body or family not in (None, "adam", "adamw"):
        f.problems.append(f"optimizer {_show(family)} is not supported; only Adam (AdamParams)")
    a = Fields(params if isinstance(params, dict) else {}, "adam_params")
    step = AdamStep(
        learning_rate=a.float("learning_rate", 1e-4, gt=0.0),  # type: ignore[arg-type]
        beta1=a.float("beta1", 0.9, ge=0.0, lt=1.0),  # type: ignore[arg-type]
        beta2=a.float("beta2", 0.95, ge=0.0, lt=1.0),  # type: ignore[arg-type]
        eps=a.float("eps", 1e-12, gt=0.0),  # type: ignore[arg-type]
        weight_decay=a.float("weight_decay", 0.0, ge=0.0),  # type: ignore[arg-type]
        grad_clip_norm=a.float("grad_clip_norm", 0.0, ge=0.0),  # type: ignore[arg-type]
    )
    f.raise_if_any(*([a] if params is not None else []))
    return model_id, seq_id, step  # type: ignore[return-value]


def read_save(body: Any, kind: str) -> tuple[str, int, Save, int | None]:
    """``(model_id, seq_id, the save, sampling_session_seq_id)`` of a ``save_weights`` (``kind="state"``)
    or ``save_weights_for_sampler`` (``kind="sampler"``) body."""
    f = Fields(body)
    model_id = f.str("model_id")
    seq_id = f.int("seq_id", 1, 2**31 - 1)
    name = f.checkpoint_name("path", required=False)
    sampling_seq = None
    if kind == "sampler" and f.body.get("path") is None:
        sampling_seq = f.int("sampling_session_seq_id", 0, 2**31 - 1)
    elif f.body.get("path") is None:
        f.problems.append("path is missing (the checkpoint's name)")
    k = f.body.get("kind", "snapshot") if kind == "sampler" else None
    if kind == "sampler" and k not in ("snapshot", "inflight"):
        f.problems.append(f"kind {_show(k)} must be 'snapshot' or 'inflight'")
    ttl = f.int("ttl_seconds", 1, required=False)
    overwrite = f.bool("overwrite", False)
    f.raise_if_any()
    save = Save(kind, name, None, bool(overwrite), ttl, inflight=k == "inflight")  # type: ignore[arg-type]
    return model_id, seq_id, save, sampling_seq  # type: ignore[return-value]


def read_sample(body: Any, *, vocab_size: int, max_context: int) -> tuple[Fields, Sample]:
    """The checked ``asample`` body (``sequence_ids`` left empty: the server names them). The returned
    :class:`Fields` holds the request's target (``sampling_session_id``, ``model_path``, ``base_model``)."""
    f = Fields(body)
    num_samples = f.int("num_samples", 1, MAX_NUM_SAMPLES, required=False, default=1)
    prompt: list[int] = []
    chunks = f.body.get("prompt", {}).get("chunks") if isinstance(f.body.get("prompt"), dict) else None
    if not isinstance(chunks, list) or not chunks:
        f.problems.append("prompt.chunks must be a non-empty list of encoded_text chunks")
        chunks = []
    if len(chunks) > MAX_PROMPT_CHUNKS:
        f.problems.append(f"prompt.chunks holds {len(chunks)} chunks; at most {MAX_PROMPT_CHUNKS}")
        chunks = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else chunk
            f.problems.append(f"prompt chunk {i} is {_show(kind)}; this server takes encoded_text only")
            continue
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            f.problems.append(f"prompt chunk {i}: tokens must be a list of integers")
            continue
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            f.problems.append(
                f"prompt chunk {i}: token id {bad[0]} is outside the vocabulary of {vocab_size}"
            )
        prompt.extend(tokens)
    if chunks and not prompt and not f.problems:
        f.problems.append("the prompt holds no token")
    p = Fields(f.body.get("sampling_params"), "sampling_params")
    room = max_context - len(prompt)
    max_tokens = p.int("max_tokens", 1, max(room, 1), required=False, default=min(room, 256))
    no_room = prompt_room_problem(len(prompt), max_context)
    if no_room is not None:
        p.problems.append(no_room)
    temperature = p.float("temperature", 1.0, ge=0.0)
    if temperature is not None:
        temperature = floored_temperature(temperature)
    top_k = p.int("top_k", required=False, default=-1)
    if top_k is not None and top_k != -1 and top_k < 1:
        p.problems.append(f"sampling_params.top_k is {top_k}; it must be -1 (no limit) or >= 1")
    top_p = p.float("top_p", 1.0, gt=0.0, le=1.0)
    if top_p is not None:
        top_p = max(top_p, MIN_TOP_P)
    seed = p.int("seed", -(2**63), 2**64 - 1, required=False)
    stop = p.body.get("stop")
    stop_strings: list[str] = []
    stop_ids: list[int] = []
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or len(stop) > MAX_STOP:
            p.problems.append(f"sampling_params.stop must be a string or a list of at most {MAX_STOP}")
        elif all(isinstance(s, str) and s for s in stop):
            stop_strings = list(stop)
        elif all(type(s) is int and 0 <= s < vocab_size for s in stop):
            stop_ids = list(stop)
        else:
            p.problems.append(
                "sampling_params.stop must hold non-empty strings or token ids in the vocabulary"
            )
    if f.body.get("model_path") is not None:  # (its target: a name that is a path is a 400 with the rest)
        parse_checkpoint_path(f.body["model_path"], "model_path", f)
    prompt_logprobs = f.bool("prompt_logprobs", False)
    for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if f.body.get(key) not in (None, 0):
            f.problems.append(f"{key} {_show(f.body[key])} is not supported by this server (only 0)")
    if f.body.get("target_prompt_logprobs") is not None:
        f.problems.append("target_prompt_logprobs is not supported by this server")
    if f.body.get("prompt_logprobs_last_n") is not None:
        f.problems.append("prompt_logprobs_last_n is not supported by this server")
    f.raise_if_any(p)
    sample = Sample(
        prompt=prompt,
        num_samples=num_samples,  # type: ignore[arg-type]
        max_tokens=max_tokens,  # type: ignore[arg-type]
        temperature=temperature,  # type: ignore[arg-type]
        top_k=top_k,  # type: ignore[arg-type]
        top_p=top_p,  # type: ignore[arg-type]
        seed=seed,
        stop_strings=stop_strings,
        stop_token_ids=stop_ids,
        stop_at_eos=stop is None,
        prompt_logprobs=bool(prompt_logprobs),
    )
    return f, sample
