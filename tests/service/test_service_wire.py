"""The service's wire format against the Tinker SDK's own codec (tinker 0.38.0): requests the SDK encodes are
read back exactly, results the service writes are read by the SDK's decoders as written, and a request that
cannot be used gets one error naming every problem."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from mlora_lab.service.wire import (  # noqa: E402
    Limits,
    Sampled,
    WireError,
    forward_backward_output,
    read_forward_backward,
    sample_response,
)

LIMITS = Limits(vocab_size=100, max_tokens=16)


def sdk_request(data, loss_fn="cross_entropy", config=None, seq_id=3) -> bytes:
    fb = types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config)
    request = types.ForwardBackwardRequest(forward_backward_input=fb, model_id="s:train:0", seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_what_the_sdk_sends_is_read_back_exactly():
    targets, weights = [5, 6, 7, 8], [0.0, 1.0, -0.5, 2.0]
    first = types.Datum(
        model_input=types.ModelInput.from_ints([1, 5, 6, 7]),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
    chunks = types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=[9, 10]), types.EncodedTextChunk(tokens=[11])]
    )
    second = types.Datum(
        model_input=chunks,
        loss_fn_inputs={
            "target_tokens": torch.tensor([10, 11, 12]),
            "logprobs": np.array([-0.5, -1.0, -2.0], dtype=np.float32),
            "advantages": torch.tensor([1.0, -1.0, 0.25]),
        },
    )
    got = read_forward_backward(
        sdk_request([first, second], "ppo", {"clip_low_threshold": 0.9, "mode": "x"}), LIMITS
    )
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("s:train:0", 3, "ppo", False)
    assert got.config == {"clip_low_threshold": 0.9, "mode": "x"}  # numbers (both maps) and text (v2)
    assert [d.tokens for d in got.data] == [[1, 5, 6, 7], [9, 10, 11]]
    a, b = got.data[0].inputs, got.data[1].inputs
    assert a["target_tokens"].dtype == torch.int64 and a["target_tokens"].tolist() == targets
    assert a["weights"].dtype == torch.float32 and a["weights"].tolist() == weights
    assert b["logprobs"].tolist() == [-0.5, -1.0, -2.0] and b["advantages"].tolist() == [1.0, -1.0, 0.25]


def test_a_sparse_tensor_is_read_dense_with_zeros_where_unlisted():
    dense = torch.tensor([[0, 3, 0], [0, 0, 0], [7, 0, 9]], dtype=torch.int64)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_torch_sparse(dense)},
    )
    got = read_forward_backward(sdk_request([datum]), LIMITS)
    assert torch.equal(got.data[0].inputs["target_tokens"], dense)


def test_forward_only_is_told_apart():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]}
    )
    fb = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    msg = forward_backward_request_to_proto(
        types.ForwardBackwardRequest(forward_backward_input=fb, model_id="m", seq_id=1)
    )
    msg.forward_only = True
    assert read_forward_backward(msg.SerializeToString(), LIMITS).forward_only


def test_every_problem_of_a_request_is_named_at_once():
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=0, loss_fn="cross_entropy")
    image = msg.data.add()
    image.model_input.add().image.data = b"\x89PNG"
    long = msg.data.add()
    long.model_input.add().encoded_text.tokens = np.arange(20, dtype="<i4").tobytes()
    bad = msg.data.add()
    bad.model_input.add().encoded_text.tokens = np.array([1, 100, -1], dtype="<i4").tobytes()
    t = bad.loss_fn_inputs["weights"]
    t.dtype, t.dense = pb.DTYPE_FLOAT32, b"\x00" * 8
    t.shape.extend([3])
    u = bad.loss_fn_inputs["target_tokens"]
    u.dtype = pb.DTYPE_INT32
    u.dense = b"\x00" * 12
    u.shape.extend([3])
    v = bad.loss_fn_inputs["advantages"]
    v.dtype = pb.DTYPE_INT64
    v.sparse_csr.values = np.array([1], dtype="<i8").tobytes()
    v.sparse_csr.crow_indices = np.array([0, 1], dtype="<i8").tobytes()
    v.sparse_csr.col_indices = np.array([5], dtype="<i8").tobytes()
    v.shape.extend([1, 3])
    with pytest.raises(WireError) as e:
        read_forward_backward(msg.SerializeToString(), LIMITS)
    problems = e.value.problems
    for expected in (
        "seq_id is 0",
        "datum 0: model_input chunk 0 is image; this server takes text tokens only",
        "datum 1: 20 input tokens; at most 16",
        "datum 2: token id 100 is outside the model's vocabulary of 100 (2 such ids)",
        "datum 2: loss_fn_inputs['weights']: 8 bytes of data for shape [3] (12 expected)",
        "datum 2: loss_fn_inputs['target_tokens']: dtype DTYPE_INT32; float32 or int64 only",
        "datum 2: loss_fn_inputs['advantages']: sparse_csr indices do not describe a 1x3 matrix of 1 values",
    ):
        assert any(expected in p for p in problems), (expected, problems)
    assert len(problems) == 7, problems
    with pytest.raises(WireError, match="not a ForwardBackwardRequest protobuf"):
        read_forward_backward(b"\xff\xff\xff", LIMITS)
    with pytest.raises(WireError, match="3 datums in one request; at most 2"):
        datum = types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={})
        read_forward_backward(sdk_request([datum] * 3), Limits(100, 16, max_datums=2))


def test_forward_backward_output_reads_in_the_sdk_as_written():
    logprobs = [
        torch.tensor([-0.5, -1.25, -3.0]),
        torch.tensor([-0.125], dtype=torch.float64),
        torch.zeros(0),
    ]
    out = deserialize_forward_backward_output(
        forward_backward_output(logprobs, {"loss:sum": 4.875, "tokens:sum": 4})
    )
    assert out.metrics == {"loss:sum": 4.875, "tokens:sum": 4.0}
    assert [o["logprobs"].to_torch().tolist() for o in out.loss_fn_outputs] == [
        [-0.5, -1.25, -3.0],
        [-0.125],
        [],
    ]
    with pytest.raises(ValueError, match="name:reduction"):
        forward_backward_output(logprobs, {"loss": 1.0})


def test_sample_response_reads_in_the_sdk_as_written():
    body = sample_response(
        [Sampled([5, 6, 2], [-0.5, -0.25, -1.0], stopped=True), Sampled([7], [-2.0], stopped=False)],
        prompt_logprobs=[None, -1.5, -0.75],
    )
    got = deserialize_sample_response(body)
    assert [s.tokens for s in got.sequences] == [[5, 6, 2], [7]]
    assert [s.logprobs for s in got.sequences] == [[-0.5, -0.25, -1.0], [-2.0]]
    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert got.prompt_logprobs[0] is None and got.prompt_logprobs[1:] == [-1.5, -0.75]
    plain = deserialize_sample_response(sample_response([Sampled([1], [-0.5], stopped=False)]))
    assert plain.prompt_logprobs is None and not math.isnan(plain.sequences[0].logprobs[0])
