"""Tinker's wire format, read and written with the SDK's own message classes (``tinker==0.38.0``,
``tinker.proto.tinker_public_pb2``): forward/backward requests in, forward/backward and sampling results out.

**In: ``ForwardBackwardRequest``** (``POST /api/v1/forward_backward``, both ``forward`` and
``forward_backward``; ``forward_only`` tells them apart). Per datum:

    model_input      chunks; only ``encoded_text`` ones (int32 little-endian token ids) are taken, joined in
                     order: the datum's input tokens ``x [N]``
    loss_fn_inputs   name -> ``Tensor`` (``dense`` bytes, or ``sparse_csr`` of a 2-D tensor: values, int64
                     ``crow_indices`` [rows + 1], int64 ``col_indices``; unlisted cells are 0), dtype
                     FLOAT32 or INT64, ``shape``: position ``t`` of each input aligns with ``x[t]``
                     (``target_tokens[t]`` is the token that follows ``x[:t + 1]``)

and for the request ``loss_fn``, ``loss_fn_config`` (the SDK writes each number to both the legacy
``map<string, double>`` and ``loss_fn_config_v2``, and text only to v2: v2 wins where both hold a key),
``forward_only``, ``model_id`` and ``seq_id``. :func:`read_forward_backward` checks all of it against the
served model (vocabulary, context length, limits) and raises one :class:`WireError` naming every problem.

**Out: ``ForwardBackwardOutput``** (the result a ``retrieve_future`` returns as ``application/x-protobuf``):
``metrics`` (``name:reduction`` keys: the SDK merges chunks by the reduction, and a key without exactly one
colon makes it raise) and one ``ArrayRecord`` whose ``logprobs`` field holds every datum's per-position
log-probabilities ``[N_i]`` (float32), concatenated, with int64 *byte* offsets ``[D + 1]``.

**Out: ``SampleResponse``**: per sequence its tokens (int32), their logprobs (float32; always sent: an empty
field reads as "none" in the SDK) and its stop reason (``stop``: a stop token or string, ``length``); the
prompt's logprobs (float32, NaN at position 0, which the SDK shows as ``None``) when asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

_DTYPES = {pb.DTYPE_FLOAT32: (np.dtype("<f4"), torch.float32), pb.DTYPE_INT64: (np.dtype("<i8"), torch.int64)}
_INT64 = np.dtype("<i8")


class WireError(ValueError):
    """A request that cannot be read or used: every problem found, one per line (a user error); the
    request's ``model_id`` and ``seq_id`` when they could be read (the seq_id is spent all the same).
    ``status``: 400, or 413 when its tensors would take more memory than the job gives one request."""

    def __init__(
        self, problems: Sequence[str], model_id: str = "", seq_id: int = 0, status: int = 400
    ) -> None:
        self.problems = list(problems)
        self.model_id, self.seq_id = model_id, seq_id
        self.status = status
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class Limits:
    """What the served model and the server accept in one request."""

    vocab_size: int
    max_tokens: int
    """Input tokens of one datum at most (the job's ``seq_len``)."""
    max_datums: int = 1024
    """Datums in one request (the SDK sends at most 1024 per chunk)."""
    max_tensor_bytes: int = 8 << 20
    """Bytes the loss inputs of one request may take once decoded (dense): the server's body limit
    (``ServiceState.max_body_bytes``), which no dense request can pass, since its bytes are in the body.
    A sparse tensor's shape, not its body, says how big it is (``[1, 2**31]`` in 100 bytes): every shape
    is checked against this, and each dimension against :attr:`max_tokens` and :attr:`vocab_size`, before
    anything is allocated."""


@dataclass(frozen=True)
class Datum:
    """One datum as the service trains on it: input tokens ``[N]`` and its loss inputs (tensors)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardBackward:
    """A decoded ``ForwardBackwardRequest``."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def read_forward_backward(body: bytes, limits: Limits) -> ForwardBackward:
    """The request in ``body`` (a serialized ``ForwardBackwardRequest``), checked against ``limits``;
    :class:`WireError` naming every problem otherwise."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError([f"the body is not a ForwardBackwardRequest protobuf ({e})"]) from None
    problems: list[str] = []
    if not msg.model_id:
        problems.append("model_id is empty")
    if msg.seq_id < 1:
        problems.append(f"seq_id is {msg.seq_id}; a training client's requests count from 1")
    if not msg.loss_fn:
        problems.append("loss_fn is empty")
    if not msg.data:
        problems.append("no data: send at least one datum")
    elif len(msg.data) > limits.max_datums:
        problems.append(f"{len(msg.data)} datums in one request; at most {limits.max_datums}")
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        which = v.WhichOneof("value")
        if which is None:
            problems.append(f"loss_fn_config_v2[{k!r}] holds neither a number nor a text")
        else:
            config[k] = float(v.number) if which == "number" else str(v.text)
    data = []
    budget = [limits.max_tensor_bytes]  # (what the request's decoded tensors may still take)
    for i, d in enumerate(msg.data[: limits.max_datums]):
        data.append(_datum(d, f"datum {i}", limits, problems, budget))
        if budget[0] < 0:
            raise WireError(
                [
                    f"datum {i}: the request's loss inputs would take more than {limits.max_tensor_bytes} "
                    "bytes decoded; send fewer datums a request"
                ],
                msg.model_id,
                msg.seq_id,
                status=413,
            )
    if problems:
        raise WireError(problems, msg.model_id, msg.seq_id)
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _datum(d: pb.Datum, where: str, limits: Limits, problems: list[str], budget: list[int]) -> Datum:
    tokens: list[int] = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            problems.append(
                f"{where}: model_input chunk {j} is {kind or 'empty'}; this server takes text tokens only"
            )
            continue
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            problems.append(f"{where}: model_input chunk {j} has {len(raw)} bytes, not int32 token ids")
            continue
        tokens.extend(np.frombuffer(raw, dtype="<i4").tolist())
    if not tokens and not any(p.startswith(f"{where}:") for p in problems):
        problems.append(f"{where}: model_input holds no token")
    if len(tokens) > limits.max_tokens:
        problems.append(
            f"{where}: {len(tokens)} input tokens; at most {limits.max_tokens} (the job's seq_len)"
        )
    bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad:
        problems.append(
            f"{where}: token id {bad[0]} is outside the model's vocabulary of {limits.vocab_size}"
            + (f" ({len(bad)} such ids)" if len(bad) > 1 else "")
        )
    inputs = {}
    for name, t in d.loss_fn_inputs.items():
        tensor = read_tensor(t, f"{where}: loss_fn_inputs[{name!r}]", problems, limits, budget)
        if tensor is not None:
            inputs[name] = tensor
        if budget[0] < 0:
            break
    return Datum(tokens, inputs)


def read_tensor(
    t: pb.Tensor,
    where: str,
    problems: list[str],
    limits: Limits | None = None,
    budget: list[int] | None = None,
) -> torch.Tensor | None:
    """A ``Tensor`` message as a dense torch tensor (a sparse CSR one filled with 0 where unlisted), or
    ``None`` with its problems added to ``problems``.

    With ``limits``, its declared shape is checked before anything is allocated: at most 2 dimensions, the
    first (positions) at most ``max_tokens`` and the second at most ``vocab_size``; ``budget`` (a one-item
    list: the bytes the request may still decode) goes down by its dense size, and below 0 the tensor is
    not decoded (the caller answers 413)."""
    if t.dtype not in _DTYPES:
        problems.append(
            f"{where}: dtype {pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else t.dtype}; "
            "float32 or int64 only"
        )
        return None
    np_dtype, torch_dtype = _DTYPES[t.dtype]
    shape = list(t.shape)
    if any(n < 0 for n in shape):
        problems.append(f"{where}: shape {shape} has a negative dimension")
        return None
    if limits is not None:
        bounds = (("positions", limits.max_tokens), ("vocabulary", limits.vocab_size))
        if len(shape) > 2:
            problems.append(f"{where}: shape {shape} has {len(shape)} dimensions; loss inputs have 1 or 2")
            return None
        over = [f"{n} > {most} ({what})" for n, (what, most) in zip(shape, bounds) if n > most]
        if over:
            problems.append(f"{where}: shape {shape} is larger than the job holds: {', '.join(over)}")
            return None
    count = math.prod(shape)
    if budget is not None:
        budget[0] -= count * np_dtype.itemsize
        if budget[0] < 0:
            return None
    encoding = t.WhichOneof("encoding")
    if encoding == "dense":
        if len(t.dense) != count * np_dtype.itemsize:
            problems.append(
                f"{where}: {len(t.dense)} bytes of data for shape {shape} "
                f"({count * np_dtype.itemsize} expected)"
            )
            return None
        return torch.from_numpy(np.frombuffer(t.dense, dtype=np_dtype).reshape(shape).copy()).to(torch_dtype)
    if encoding == "sparse_csr":
        return _csr(t.sparse_csr, shape, np_dtype, torch_dtype, where, problems)
    problems.append(f"{where}: holds no data (neither dense nor sparse_csr)")
    return None


def _csr(
    csr: pb.SparseCsr,
    shape: list[int],
    np_dtype: np.dtype,
    torch_dtype: torch.dtype,
    where: str,
    problems: list[str],
) -> torch.Tensor | None:
    if len(shape) != 2:
        problems.append(f"{where}: a sparse_csr tensor is 2-D, its shape is {shape}")
        return None
    rows, cols = shape
    sizes = (len(csr.values), len(csr.crow_indices), len(csr.col_indices))
    if sizes[0] % np_dtype.itemsize or sizes[1] % 8 or sizes[2] % 8:
        problems.append(
            f"{where}: sparse_csr buffers of {sizes} bytes do not hold whole values and int64 indices"
        )
        return None
    values = np.frombuffer(csr.values, dtype=np_dtype)
    crow = np.frombuffer(csr.crow_indices, dtype=_INT64)
    col = np.frombuffer(csr.col_indices, dtype=_INT64)
    ok = (
        len(crow) == rows + 1
        and len(col) == len(values)
        and crow[0] == 0
        and crow[-1] == len(values)
        and bool(np.all(np.diff(crow) >= 0))
        and bool(np.all((col >= 0) & (col < cols)))
    )
    if not ok:
        problems.append(
            f"{where}: sparse_csr indices do not describe a {rows}x{cols} matrix of {len(values)} values"
        )
        return None
    dense = np.zeros((rows, cols), dtype=np_dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return torch.from_numpy(dense).to(torch_dtype)


def forward_backward_output(logprobs: Sequence[torch.Tensor], metrics: Mapping[str, float]) -> bytes:
    """A serialized ``ForwardBackwardOutput``: the metrics (``name:reduction`` keys) and each datum's
    per-position ``logprobs`` ``[N_i]`` in one ``ArrayRecord`` (float32, byte offsets)."""
    bad = [k for k in metrics if k.count(":") != 1]
    if bad:
        raise ValueError(f"metric names take the form name:reduction (one colon): {bad}")
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    field_ = record.fields["logprobs"]
    field_.dtype = pb.DTYPE_FLOAT32
    arrays = [lp.detach().to(torch.float32).reshape(-1).cpu().numpy().astype("<f4") for lp in logprobs]
    field_.data = b"".join(a.tobytes() for a in arrays)
    field_.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).astype(_INT64).tobytes()
    return out.SerializeToString()


@dataclass(frozen=True)
class Sampled:
    """One sampled sequence for :func:`sample_response`."""

    tokens: Sequence[int]
    logprobs: Sequence[float]
    stopped: bool
    """Ended at a stop token or string (``stop``); otherwise at its token limit (``length``)."""


def sample_response(
    sequences: Sequence[Sampled], prompt_logprobs: Sequence[float | None] | None = None
) -> bytes:
    """A serialized ``SampleResponse``: the sequences in order and, when given, the prompt's logprobs
    (``None`` entries, position 0 always, sent as NaN)."""
    out = pb.SampleResponse()
    for s in sequences:
        if len(s.tokens) != len(s.logprobs):
            raise ValueError(f"{len(s.tokens)} tokens but {len(s.logprobs)} logprobs in a sequence")
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        values = [math.nan if x is None else x for x in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    return out.SerializeToString()
