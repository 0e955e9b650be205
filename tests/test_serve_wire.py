"""plexrl/serve/wire.py against the Tinker SDK's own encoders and decoders.

Every round trip runs through the real SDK (tinker==0.38.0): its request_conv encodes what we
decode, its response_conv decodes what we encode, and its JSON bodies are dumped the way its
resources dump them. Malformed bodies are built with the SDK's protobuf classes, so each case
breaks exactly one thing and its WireError must say which.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tinker import types as T
from tinker._compat import model_dump
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as pb

from plexrl.api import types as P
from plexrl.serve import wire
from plexrl.serve.wire import WireError


def sdk_body(data, loss_fn="cross_entropy", loss_fn_config=None, seq_id=1, model_id="s:train:0"):
    """The bytes TrainingClient.forward_backward POSTs for `data` (SDK Datums)."""
    request = T.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id,
        forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config))
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def sdk_json(request):
    """A request body as the SDK's resources send it."""
    return model_dump(request, exclude_unset=False, exclude_none=True, mode="json")


def assert_wire_error(function, argument, fragments):
    with pytest.raises(WireError) as raised:
        function(argument)
    missing = [fragment for fragment in fragments if fragment not in str(raised.value)]
    assert not missing, f"the message {str(raised.value)!r} lacks {missing}"


def inputs_of(datum):
    return {name: tensor.to_numpy() for name, tensor in datum.loss_fn_inputs.items()}


# ---------------------------------------------------------------------------- forward_backward in

def test_sdk_request_decodes_to_the_same_call():
    targets = np.array([5, 6, 7, 8], dtype=np.int64)
    weights = np.array([1.0, -2.5, 0.0, 3.25], dtype=np.float32)
    grid = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = [T.Datum(model_input=T.ModelInput(chunks=[T.EncodedTextChunk(tokens=[1, 2]),
                                                     T.EncodedTextChunk(tokens=[3, 70000])]),
                    loss_fn_inputs={"target_tokens": T.TensorData.from_numpy(targets),
                                    "weights": T.TensorData.from_numpy(weights)}),
            T.Datum(model_input=T.ModelInput.from_ints([9]),
                    loss_fn_inputs={"target_tokens": T.TensorData(data=[4], dtype="int64"),  # no shape: 1-D
                                    "grid": T.TensorData.from_numpy(grid)})]
    call = wire.decode_forward_backward(sdk_body(data, "ppo", {"clip_low_threshold": 0.7, "mode": "x"}, seq_id=7))
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": 0.7, "mode": "x"}
    assert [c.tokens for c in call.data[0].model_input.chunks] == [(1, 2), (3, 70000)]
    assert call.data[1].model_input.to_ints() == [9]
    first, second = inputs_of(call.data[0]), inputs_of(call.data[1])
    assert first["target_tokens"].dtype == np.int64 and first["target_tokens"].tolist() == targets.tolist()
    assert first["weights"].dtype == np.float32 and first["weights"].tolist() == weights.tolist()
    assert second["target_tokens"].tolist() == [4]
    assert second["grid"].shape == (2, 3) and second["grid"].tolist() == grid.tolist()
    assert isinstance(call.data[0], P.Datum)


def test_forward_only_and_missing_config():
    data = [T.Datum(model_input=T.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})]
    message = request_conv.forward_backward_request_to_proto(T.ForwardBackwardRequest(
        model_id="m", seq_id=2, forward_backward_input=T.ForwardBackwardInput(data=data, loss_fn="cross_entropy")))
    message.forward_only = True  # what TrainingClient.forward sends
    call = wire.decode_forward_backward(message.SerializeToString())
    assert call.forward_only is True and call.loss_fn_config == {}


def test_config_v2_is_preferred_over_the_legacy_map():
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="dro", loss_fn_config={"beta": 1.0})
    assert wire.decode_forward_backward(message.SerializeToString()).loss_fn_config == {"beta": 1.0}
    message.loss_fn_config_v2["beta"].number = 2.0
    assert wire.decode_forward_backward(message.SerializeToString()).loss_fn_config == {"beta": 2.0}


def test_sparse_csr_inputs_are_densified():
    dense = torch.tensor([[0.0, 1.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, -3.0]])
    sparse = T.TensorData.from_torch_sparse(dense)
    assert sparse.sparse_crow_indices is not None, "the SDK chose CSR for this mostly-zero tensor"
    by_hand = T.TensorData(data=[7, 9], dtype="int64", shape=[2, 3], sparse_crow_indices=[0, 1, 2],
                           sparse_col_indices=[2, 0])
    data = [T.Datum(model_input=T.ModelInput.from_ints([1]), loss_fn_inputs={"a": sparse, "b": by_hand})]
    inputs = inputs_of(wire.decode_forward_backward(sdk_body(data)).data[0])
    assert inputs["a"].tolist() == dense.tolist()
    assert inputs["b"].dtype == np.int64 and inputs["b"].tolist() == [[0, 0, 7], [9, 0, 0]]


def one_tensor_request(tensor, tokens=b"\x01\x00\x00\x00"):
    """A request whose one datum has one token and `tensor` as loss_fn_inputs['x']."""
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = tokens
    datum.loss_fn_inputs["x"].CopyFrom(tensor)
    return message.SerializeToString()


def test_int32_and_bfloat16_tensors_widen():
    """The SDK only writes float32 and int64, but the proto allows int32 and bfloat16 too."""
    ints = np.array([-3, 0, 2**31 - 1], dtype=np.int32)
    floats = np.array([1.5, -2.0, 0.15625, 2.0**100], dtype=np.float32)  # bfloat16-exact values
    bf16 = (floats.view(np.uint32) >> 16).astype(np.uint16)
    got_ints = wire.decode_forward_backward(one_tensor_request(
        pb.Tensor(dtype=pb.DTYPE_INT32, dense=ints.tobytes()))).data[0].loss_fn_inputs["x"]
    got_floats = wire.decode_forward_backward(one_tensor_request(
        pb.Tensor(dtype=pb.DTYPE_BFLOAT16, dense=bf16.tobytes(), shape=[2, 2]))).data[0].loss_fn_inputs["x"]
    assert got_ints.dtype == "int64" and got_ints.tolist() == ints.tolist()
    assert got_floats.dtype == "float32" and got_floats.to_numpy().tolist() == floats.reshape(2, 2).tolist()


def sdk_tensor(array):
    return T.TensorData.from_numpy(array)


tensors = st.one_of(
    hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),
               elements=st.floats(-1e6, 1e6, width=32)),
    hnp.arrays(np.int64, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),
               elements=st.integers(-2**63, 2**63 - 1)))
datums = st.tuples(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=5), min_size=1, max_size=3),
                   st.dictionaries(st.sampled_from(["target_tokens", "weights", "logprobs", "advantages"]), tensors))


@settings(max_examples=60, deadline=None)
@given(st.lists(datums, min_size=1, max_size=4))
def test_any_sdk_request_round_trips(rows):
    data = [T.Datum(model_input=T.ModelInput(chunks=[T.EncodedTextChunk(tokens=c) for c in chunks]),
                    loss_fn_inputs={k: sdk_tensor(v) for k, v in arrays.items()}) for chunks, arrays in rows]
    call = wire.decode_forward_backward(sdk_body(data))
    assert len(call.data) == len(rows)
    for datum, (chunks, arrays) in zip(call.data, rows):
        assert [list(c.tokens) for c in datum.model_input.chunks] == chunks
        got = inputs_of(datum)
        assert set(got) == set(arrays)
        for name, array in arrays.items():
            assert got[name].dtype == array.dtype and got[name].shape == array.shape
            assert np.array_equal(got[name], array)


# ---------------------------------------------------------------------------- malformed requests

def request_with(**change):
    """A valid one-datum request with one field of it replaced by `change`'s builder."""
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], dtype=np.int32).tobytes()
    datum.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2],
                                                       dense=np.ones(2, dtype=np.float32).tobytes()))
    for builder in change.values():
        builder(message)
    return message.SerializeToString()


def set_tensor(**fields):
    return lambda m: m.data[0].loss_fn_inputs["weights"].CopyFrom(pb.Tensor(**fields))


def csr(values, crow, col, shape, dtype=np.float32):
    return set_tensor(dtype=pb.DTYPE_FLOAT32 if dtype == np.float32 else pb.DTYPE_INT64, shape=shape,
                      sparse_csr=pb.SparseCsr(values=np.array(values, dtype=dtype).tobytes(),
                                              crow_indices=np.array(crow, dtype=np.int64).tobytes(),
                                              col_indices=np.array(col, dtype=np.int64).tobytes()))


def chunk(**fields):
    def build(m):
        m.data[0].ClearField("model_input")
        m.data[0].model_input.add(**fields)
    return build


W = "data[0].loss_fn_inputs['weights']"
MALFORMED = {
    "garbage bytes": (b"\xff\xfe\x01garbage", ["not a ForwardBackwardRequest protobuf", "x-protobuf"]),
    "a str, not bytes": ("model_id: m", ["is a str", "expected protobuf bytes"]),
    "empty model_id": (request_with(f=lambda m: m.ClearField("model_id")), ["model_id is empty"]),
    "seq_id 0 (the SDK's None)": (request_with(f=lambda m: setattr(m, "seq_id", 0)), ["seq_id=0", ">= 1"]),
    "empty loss_fn": (request_with(f=lambda m: m.ClearField("loss_fn")), ["loss_fn is empty", "'cross_entropy'"]),
    "tokens not a multiple of 4 bytes": (
        request_with(f=lambda m: setattr(m.data[0].model_input[0].encoded_text, "tokens", b"\x01\x00\x00\x00\x02")),
        ["data[0].model_input[0].encoded_text.tokens has 5 bytes", "multiple of 4", "int32"]),
    "float32 data not a multiple of 4 bytes": (
        request_with(f=set_tensor(dtype=pb.DTYPE_FLOAT32, dense=b"\x00" * 7)), [f"{W}.dense has 7 bytes", "float32"]),
    "int64 data not a multiple of 8 bytes": (
        request_with(f=set_tensor(dtype=pb.DTYPE_INT64, dense=b"\x00" * 12)), ["12 bytes", "multiple of 8", "int64"]),
    "shape does not match the data": (
        request_with(f=set_tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 2], dense=b"\x00" * 12)),
        [W, "3 float32 values do not fit shape [2, 2]", "expected 4 values"]),
    "negative size": (request_with(f=set_tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1], dense=b"")),
                      [W, "shape [-1]", "sizes from 0"]),
    "shape too large for numpy": (
        request_with(f=set_tensor(dtype=pb.DTYPE_FLOAT32, shape=[0, 2**24, 2**24, 2**24], dense=b"")),
        [W, "too large"]),
    "dtype unspecified": (request_with(f=set_tensor(dense=b"\x00" * 8)),
                          [W, "DTYPE_UNSPECIFIED (0)", "expected DTYPE_FLOAT32"]),
    "dtype out of the enum": (request_with(f=set_tensor(dtype=99, dense=b"")), ["99 (not a DType)"]),
    "image chunk": (request_with(f=chunk(image=pb.ImageChunk(data=b"png", format="png"))),
                    ["data[0].model_input[0] is an image chunk", "text models only"]),
    "audio chunk": (request_with(f=chunk(dmel=pb.DmelChunk(dmel=b"x"))), ["an audio (dmel) chunk"]),
    "empty chunk": (request_with(f=chunk()), ["data[0].model_input[0] is an empty chunk"]),
    "sparse tensor not 2-D": (request_with(f=csr([1.0], [0, 1], [0], shape=[3])), [W, "expected a 2-D shape"]),
    "sparse row pointers wrong": (request_with(f=csr([1.0, 2.0], [0, 1], [0, 1], shape=[2, 3])),
                                  [W, "crow_indices [0, 1]", "3 non-decreasing row pointers", "(2)"]),
    "sparse row pointers decreasing": (request_with(f=csr([1.0], [0, 2, 1], [0], shape=[2, 3])), ["row pointers"]),
    "sparse column out of range": (request_with(f=csr([1.0], [0, 1, 1], [3], shape=[2, 3])),
                                   [W, "col_indices [3]", "columns in [0, 3)"]),
    "sparse column count wrong": (request_with(f=csr([1.0, 2.0], [0, 1, 2], [0], shape=[2, 3])),
                                  ["1 col_indices for 2 values"]),
    "sparse cell listed twice": (request_with(f=csr([1.0, 2.0], [0, 2, 2], [1, 1], shape=[2, 3])), ["cell twice"]),
    "sparse shape too large to densify": (request_with(f=csr([], [0] * 4097, [], shape=[4096, 4097])),
                                          ["16,781,314 tokens and tensor values", "at most 16,777,216"]),
    "config value with neither arm": (request_with(f=lambda m: m.loss_fn_config_v2["beta"].SetInParent()),
                                      ["loss_fn_config_v2['beta'] holds neither a number nor text"]),
}


@pytest.mark.parametrize("body, fragments", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_request_says_what_and_where(body, fragments):
    assert_wire_error(wire.decode_forward_backward, body, fragments)


def test_a_request_is_bounded_in_all_before_anything_is_densified():
    """Each tensor is capped (MAX_DENSE_VALUES), and so is the request: tensors that are each
    small enough but many are refused from their shapes, before any is densified."""
    def sparse(name, columns):
        return lambda m: m.data[0].loss_fn_inputs[name].CopyFrom(pb.Tensor(
            dtype=pb.DTYPE_FLOAT32, shape=[1, columns], sparse_csr=pb.SparseCsr(
                values=b"", crow_indices=np.array([0, 0], dtype=np.int64).tobytes(), col_indices=b"")))

    bomb = request_with(**{f"t{i}": sparse(f"advantages{i}", 1 << 21) for i in range(3)})
    assert_wire_error(lambda body: wire.decode_forward_backward(body, max_values=1 << 22), bomb,
                      ["6,291,460 tokens and tensor values", "at most 4,194,304", "split it"])
    call = wire.decode_forward_backward(bomb, max_values=1 << 23)
    assert call.data[0].loss_fn_inputs["advantages0"].shape == (1, 1 << 21)
    one_too_large = request_with(f=csr([], [0] * 4097, [], shape=[4096, 4097]))
    assert_wire_error(lambda body: wire.decode_forward_backward(body, max_values=1 << 30), one_too_large,
                      ["densifies to 16781312 values", f"at most {wire.MAX_DENSE_VALUES}"])


VALID = request_with()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.integers(0, len(VALID)).map(lambda n: VALID[:n])
       | st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)).map(
           lambda p: VALID[:p[0]] + bytes([p[1]]) + VALID[p[0] + 1:]))
def test_any_bytes_decode_or_give_a_wire_error(body):
    """Random, truncated and bit-flipped bodies: a call or a WireError, never anything else."""
    try:
        call = wire.decode_forward_backward(body)
    except WireError:
        return
    assert isinstance(call, wire.ForwardBackwardCall) and call.model_id and call.seq_id >= 1


# ---------------------------------------------------------------------------- forward_backward out

def sdk_outputs(output):
    return response_conv.deserialize_forward_backward_output(wire.encode_forward_backward_output(output))


def test_plexrl_output_reads_back_in_the_sdk():
    logprobs = [np.array([-0.5, -1.25], dtype=np.float32), np.array([-3.0], dtype=np.float32)]
    output = P.ForwardBackwardOutput([{"logprobs": P.TensorData.of(lp)} for lp in logprobs],
                                     {"loss:sum": 4.75, "clipped": 0.5})
    decoded = sdk_outputs(output)
    assert decoded.loss_fn_output_type == "ArrayRecord"
    assert [d["logprobs"].to_numpy().tolist() for d in decoded.loss_fn_outputs] == [lp.tolist() for lp in logprobs]
    assert decoded.metrics == {"loss:sum": 4.75, "clipped:mean": 0.5}


def test_mixed_shapes_split_into_records_and_partial_fields_are_left_out():
    output = P.ForwardBackwardOutput([
        {"values": P.TensorData.of(np.zeros((2, 3), np.float32)), "logprobs": P.TensorData.of(np.ones(2, np.float32))},
        {"values": P.TensorData.of(np.ones((1, 4), np.float32))},
        {"values": P.TensorData.of(np.arange(3, dtype=np.int64))},
    ], {})
    message = pb.ForwardBackwardOutput()
    message.ParseFromString(wire.encode_forward_backward_output(output))
    assert [r.num_datums for r in message.loss_fn_outputs] == [1, 1, 1]
    decoded = sdk_outputs(output).loss_fn_outputs
    assert [set(d) for d in decoded] == [{"values"}] * 3, "logprobs is on one datum only, so on none"
    assert [tuple(d["values"].shape) for d in decoded] == [(2, 3), (1, 4), (3,)]
    assert decoded[2]["values"].dtype == "int64" and decoded[2]["values"].to_numpy().tolist() == [0, 1, 2]


def test_no_outputs_and_scalars():
    assert sdk_outputs(P.ForwardBackwardOutput([], {"loss:sum": 0.0})).loss_fn_outputs == []
    assert sdk_outputs(P.ForwardBackwardOutput([{}, {}], {})).loss_fn_outputs == [{}, {}]
    scalar = sdk_outputs(P.ForwardBackwardOutput([{"v": P.TensorData.of(np.float32(2.5))}], {})).loss_fn_outputs
    assert scalar[0]["v"].shape == [1] and scalar[0]["v"].to_numpy().tolist() == [2.5]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_output_round_trips_through_the_sdk(data):
    names = data.draw(st.lists(st.sampled_from(["logprobs", "values", "extra"]), unique=True))
    trailing = {name: data.draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3)) for name in names}
    dtypes = {name: data.draw(st.sampled_from([np.float32, np.int64])) for name in names}
    outputs = []
    for _ in range(data.draw(st.integers(1, 4))):
        if data.draw(st.booleans()):  # sometimes the next datums change trailing shape: a new record
            trailing = {name: data.draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
                        for name in names}
        outputs.append({name: data.draw(hnp.arrays(
            dtypes[name], (data.draw(st.integers(0, 4)),) + trailing[name],
            elements=st.floats(-1e6, 1e6, width=32) if dtypes[name] == np.float32 else st.integers(-2**63, 2**63 - 1)))
            for name in names})
    decoded = sdk_outputs(P.ForwardBackwardOutput([{k: P.TensorData.of(v) for k, v in o.items()} for o in outputs],
                                                  {"loss:sum": 1.0}))
    assert len(decoded.loss_fn_outputs) == len(outputs)
    for got, sent in zip(decoded.loss_fn_outputs, outputs):
        assert set(got) == set(sent)
        for name, array in sent.items():
            assert tuple(got[name].shape) == array.shape and got[name].dtype == array.dtype.name
            assert np.array_equal(got[name].to_numpy(), array)


BAD_OUTPUTS = {
    "not an output": ({"loss": 1.0}, ["expected a plexrl ForwardBackwardOutput"]),
    "not a TensorData": (P.ForwardBackwardOutput([{"logprobs": [1.0]}], {}),
                         ["loss_fn_outputs[0]['logprobs']", "expected a TensorData"]),
    "data that does not fit its shape": (
        P.ForwardBackwardOutput([{"logprobs": P.TensorData((1.0, 2.0, 3.0), "float32", (2, 2))}], {}),
        ["loss_fn_outputs[0]['logprobs'] does not convert", "(2, 2)"]),
    "zero-sized trailing dimension": (P.ForwardBackwardOutput([{"v": P.TensorData.of(np.zeros((2, 0)))}], {}),
                                      ["shape (2, 0)", "no zero-sized dimension after the first"]),
    "metric not a number": (P.ForwardBackwardOutput([], {"loss:sum": "1"}), ["metric 'loss:sum'='1'", "a number"]),
}


@pytest.mark.parametrize("output, fragments", BAD_OUTPUTS.values(), ids=BAD_OUTPUTS.keys())
def test_unencodable_output_says_why(output, fragments):
    assert_wire_error(wire.encode_forward_backward_output, output, fragments)


# ---------------------------------------------------------------------------- metrics

METRICS = {
    "forward_backward's loss is a sum": ({"loss:sum": 3.0}, {"loss:sum": 3.0}),
    "bare loss becomes a sum": ({"loss": 3.0}, {"loss:sum": 3.0}),
    "optim_step's": ({"grad_norm": 1.5, "step": 4.0, "learning_rate": 1e-4},
                     {"grad_norm:mean": 1.5, "step:max": 4.0, "learning_rate:mean": 1e-4}),
    "other bare names are means": ({"kl": 0.25}, {"kl:mean": 0.25}),
    "every Tinker reduction passes": ({f"m:{r}": 1.0 for r in wire.REDUCTIONS}, {f"m:{r}": 1.0 for r in wire.REDUCTIONS}),
    "unknown reduction": ({"kl:median": 1.0}, {"kl/median:mean": 1.0}),
    "two colons": ({"a:b:sum": 1.0}, {"a/b/sum:mean": 1.0}),
    "no name": ({":sum": 1.0}, {"/sum:mean": 1.0}),
    "Tinker's form wins a collision": ({"loss": 1.0, "loss:sum": 2.0}, {"loss:sum": 2.0}),
    "numpy and int values": ({"a:sum": np.float32(0.5), "b:max": 3}, {"a:sum": 0.5, "b:max": 3.0}),
}


@pytest.mark.parametrize("metrics, expected", METRICS.values(), ids=METRICS.keys())
def test_tinker_metrics(metrics, expected):
    converted = wire.tinker_metrics(metrics)
    assert converted == expected
    assert all(key.count(":") == 1 and key.split(":")[1] in wire.REDUCTIONS for key in converted)


def test_mapped_metrics_survive_the_sdks_chunk_reduction():
    """The SDK splits every key at its colon when it combines a chunked forward_backward."""
    from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results

    chunks = [sdk_outputs(P.ForwardBackwardOutput([{}], {"loss": loss, "odd:key:x": 1.0})) for loss in (1.0, 2.5)]
    assert combine_fwd_bwd_output_results(chunks).metrics == {"loss:sum": 3.5, "odd/key/x:mean": 1.0}


# ---------------------------------------------------------------------------- sample out

def test_sample_response_reads_back_in_the_sdk():
    response = P.SampleResponse([P.SampledSequence([5, 6, 2], [-0.5, -1.0, -0.25], "stop"),
                                 P.SampledSequence([7], [-2.0], "length"),
                                 P.SampledSequence([], [], "length")],
                                prompt_logprobs=[None, -1.5, -0.75])
    decoded = response_conv.deserialize_sample_response(wire.encode_sample_response(response))
    assert [(s.tokens, s.stop_reason) for s in decoded.sequences] == [([5, 6, 2], "stop"), ([7], "length"), ([], "length")]
    assert decoded.sequences[0].logprobs == [-0.5, -1.0, -0.25] and decoded.sequences[1].logprobs == [-2.0]
    assert decoded.prompt_logprobs == [None, -1.5, -0.75]


def test_prompt_logprobs_absent_unless_asked():
    response = P.SampleResponse([P.SampledSequence([1], [-0.1], "stop")])
    assert response_conv.deserialize_sample_response(wire.encode_sample_response(response)).prompt_logprobs is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 2**31 - 1), st.floats(-50, 0, width=32)), max_size=6),
                          st.sampled_from(["stop", "length"])), max_size=4),
       st.none() | st.lists(st.none() | st.floats(-50, 0, width=32), max_size=6).map(lambda lp: [None] + lp))
def test_any_sample_response_round_trips(sequences, prompt_logprobs):
    response = P.SampleResponse([P.SampledSequence([t for t, _ in rows], [lp for _, lp in rows], reason)
                                 for rows, reason in sequences], prompt_logprobs)
    decoded = response_conv.deserialize_sample_response(wire.encode_sample_response(response))
    assert [(s.tokens, s.logprobs or [], s.stop_reason) for s in decoded.sequences] == \
        [(seq.tokens, seq.logprobs, seq.stop_reason) for seq in response.sequences]
    assert decoded.prompt_logprobs == prompt_logprobs


BAD_SAMPLES = {
    "unknown stop reason": (P.SampleResponse([P.SampledSequence([1], [0.0], "eos")]),
                            ["sequences[0].stop_reason='eos'", "'stop' or 'length'"]),
    "token beyond int32": (P.SampleResponse([P.SampledSequence([2**31], [0.0], "stop")]),
                           ["sequences[0].tokens", "fit int32"]),
    "float token": (P.SampleResponse([P.SampledSequence([1.5], [0.0], "stop")]), ["integer token ids"]),
    "logprob per token": (P.SampleResponse([P.SampledSequence([1, 2], [0.0], "stop")]),
                          ["2 tokens and 1 logprobs", "one logprob per token"]),
    "logprob not a number": (P.SampleResponse([P.SampledSequence([1], ["x"], "stop")]),
                             ["sequences[0].logprobs=['x']", "flat list of numbers"]),
    "prompt logprob not a number": (P.SampleResponse([], prompt_logprobs=[None, "a"]), ["prompt_logprobs"]),
    "not a response": ([1, 2], ["expected a plexrl SampleResponse"]),
}


@pytest.mark.parametrize("response, fragments", BAD_SAMPLES.values(), ids=BAD_SAMPLES.keys())
def test_unencodable_sample_response_says_why(response, fragments):
    assert_wire_error(wire.encode_sample_response, response, fragments)


# ---------------------------------------------------------------------------- JSON bodies

def test_tinker_and_plexrl_adam_params_are_the_same_fields_and_defaults():
    tinker_defaults = T.AdamParams().model_dump()
    assert tinker_defaults == {k: getattr(P.AdamParams(), k) for k in tinker_defaults}
    assert set(tinker_defaults) == set(P.AdamParams.__dataclass_fields__)


def test_optim_step_body_decodes():
    request = T.OptimStepRequest(model_id="m", seq_id=3, adam_params=T.AdamParams(
        learning_rate=3e-5, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0))
    body = sdk_json(request)
    assert wire.adam_params(body["adam_params"]) == P.AdamParams(3e-5, 0.8, 0.99, 1e-8, 0.01, 1.0)
    assert wire.adam_params({"learning_rate": 1}) == P.AdamParams(learning_rate=1.0)
    assert wire.adam_params({"grad_clip_norm": 0.0}).grad_clip_norm == 0.0, "0 is no clipping, in both"


STOPS = {
    "none keeps EOS": (None, None),
    "a string": ("\n\nUser:", ("\n\nUser:",)),
    "strings": (["a", "bc"], ("a", "bc")),
    "token ids": ([2, 13], (2, 13)),
    "empty: no stop at all": ([], ()),
}


@pytest.mark.parametrize("stop, expected", STOPS.values(), ids=STOPS.keys())
def test_asample_body_decodes(stop, expected):
    request = T.SampleRequest(num_samples=2, prompt=T.ModelInput(chunks=[T.EncodedTextChunk(tokens=[1, 5]),
                                                                          T.EncodedTextChunk(tokens=[6])]),
                              sampling_params=T.SamplingParams(max_tokens=12, seed=7, stop=stop, temperature=0.5,
                                                               top_k=40, top_p=0.9),
                              sampling_session_id="ss", seq_id=1)
    body = sdk_json(request)
    assert wire.sampling_params(body["sampling_params"]) == P.SamplingParams(12, 0.5, 40, 0.9, 7, expected)
    prompt = wire.model_input(body["prompt"])
    assert [c.tokens for c in prompt.chunks] == [(1, 5), (6,)]


def test_sampling_defaults_match_and_max_tokens_falls_back():
    sdk = T.SamplingParams()
    plexrl = wire.sampling_params(sdk_json(sdk))
    assert (plexrl.temperature, plexrl.top_k, plexrl.top_p, plexrl.seed) == (sdk.temperature, sdk.top_k, sdk.top_p, sdk.seed)
    assert sdk.max_tokens is None and plexrl.max_tokens == P.SamplingParams().max_tokens
    assert set(T.SamplingParams.model_fields) <= set(P.SamplingParams.__dataclass_fields__)


BAD_JSON = {
    "adam not an object": (wire.adam_params, [0.1], ["adam_params=[0.1]", "expected a JSON object"]),
    "adam unknown field": (wire.adam_params, {"momentum": 0.9}, ["unknown fields ['momentum']", "'learning_rate'"]),
    "adam string rate": (wire.adam_params, {"learning_rate": "1e-4"}, ["adam_params", "learning_rate='1e-4'"]),
    "adam bool": (wire.adam_params, {"beta1": True}, ["beta1=True"]),
    "adam negative clip": (wire.adam_params, {"grad_clip_norm": -1.0}, ["grad_clip_norm=-1.0", "0 disables"]),
    "adam null": (wire.adam_params, {"eps": None}, ["eps=None"]),
    "sampling unknown field": (wire.sampling_params, {"n": 2}, ["sampling_params has unknown fields ['n']"]),
    "sampling float top_k": (wire.sampling_params, {"top_k": 1.5}, ["sampling_params", "top_k=1.5"]),
    "sampling zero max_tokens": (wire.sampling_params, {"max_tokens": 0}, ["max_tokens=0", "integer >= 1"]),
    "sampling mixed stop": (wire.sampling_params, {"stop": ["a", 2]}, ["mixes strings and token ids"]),
    "sampling empty stop string": (wire.sampling_params, {"stop": ""}, ["stop=''"]),
    "sampling null temperature": (wire.sampling_params, {"temperature": None}, ["temperature=None"]),
    "input not an object": (wire.model_input, [1, 2], ["model_input=[1, 2]", "expected a JSON object"]),
    "input without chunks": (wire.model_input, {}, ["model_input has no chunks"]),
    "chunks not a list": (wire.model_input, {"chunks": "abc"}, ["model_input.chunks='abc'", "a list"]),
    "image chunk": (wire.model_input, {"chunks": [{"type": "image", "data": "", "format": "png"}]},
                    ["model_input.chunks[0] is an image chunk", "text models only"]),
    "unknown chunk type": (wire.model_input, {"chunks": [{"type": "video"}]},
                           ["model_input.chunks[0]=", "'encoded_text'"]),
    "chunk not an object": (wire.model_input, {"chunks": [[1, 2]]}, ["model_input.chunks[0]=[1, 2]"]),
    "chunk extra field": (wire.model_input, {"chunks": [{"type": "encoded_text", "tokens": [1], "len": 1}]},
                          ["model_input.chunks[0] has unknown fields ['len']"]),
    "chunk without tokens": (wire.model_input, {"chunks": [{"type": "encoded_text"}]}, ["has no tokens"]),
    "float token": (wire.model_input, {"chunks": [{"type": "encoded_text", "tokens": [1, 5.5]}]},
                    ["model_input.chunks[0]: tokens[1]=5.5", "integer token id"]),
    "tokens a string": (wire.model_input, {"chunks": [{"type": "encoded_text", "tokens": "12"}]},
                        ["tokens='12'", "sequence of integer token ids"]),
}


@pytest.mark.parametrize("function, body, fragments", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_bad_json_body_names_the_field(function, body, fragments):
    assert_wire_error(function, body, fragments)


def test_model_input_names_what_it_decodes():
    with pytest.raises(WireError, match=r"^prompt has no chunks"):
        wire.model_input({}, what="prompt")
    assert wire.model_input({"chunks": [{"tokens": [3]}]}).to_ints() == [3], "type defaults to encoded_text"
    assert math.isclose(wire.sampling_params({"top_p": 1}).top_p, 1.0)
