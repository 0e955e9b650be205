"""The Tinker SDK's wire formats <-> plexrl.api types: what `plexrl serve` reads and writes.

The SDK (tinker==0.38.0) sends forward_backward as a protobuf `ForwardBackwardRequest` and takes
forward_backward and sample results back as protobufs; everything else is JSON. The schema is the
SDK's own (`tinker.proto.tinker_public_pb2`) and so are the JSON field names (`tinker.types`), never
copies, so an SDK that changes them fails here loudly instead of being misread.

Conventions on the wire (the SDK's proto/request_conv.py encodes, proto/response_conv.py decodes):
- tokens are int32 bytes; a `Tensor` is dense bytes or sparse CSR (values in its dtype, crow and
  col indices int64) plus a shape, an empty shape meaning 1-D (a TensorData without a shape);
- a forward_backward result is `ArrayRecord`s of `BatchedTensor`s: per output field, every datum's
  bytes concatenated, n+1 int64 byte offsets, a dtype, and the shape after the first dimension;
- sampled tokens int32, logprobs float32, prompt logprobs float32 with NaN where there is none
  (always position 0); stop reasons STOP=0, LENGTH=1;
- metric keys are `name:reduction` with exactly one colon; `tinker_metrics` says how plexrl's
  names map.

Invariants (tests/test_serve_wire.py):
- what the SDK encodes decodes to the same tokens and loss_fn_inputs (int32 widened to int64,
  bfloat16 to float32, sparse CSR densified with 0, the SDK's default pad value);
- what we encode, the SDK's decoders give back unchanged: per-datum tensors (shape and dtype),
  tokens, logprobs, stop reasons, prompt logprobs;
- bad input of any kind raises `WireError` (a ValueError) naming the field, what it held and what
  was expected; never a protobuf DecodeError, numpy error, KeyError or TypeError.

Out of scope: image and audio (dmel) chunks (plexrl serves text models), provenance spans (they
feed `stable_reinforce`, which plexrl does not have), top-k and target prompt logprobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Mapping

import numpy as np
from google.protobuf.message import DecodeError
from tinker import types as tinker_types
from tinker.proto import tinker_public_pb2 as pb

from plexrl.api import errors
from plexrl.api.types import (AdamParams, Datum, EncodedTextChunk, ForwardBackwardOutput, ModelInput,
                              SampledSequence, SampleResponse, SamplingParams, TensorData, shown, token_ids)


class WireError(ValueError):
    """A body that does not fit the Tinker wire format, or a result the format cannot carry."""


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded /forward_backward (or /forward: `forward_only`) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]  # empty when none was given
    forward_only: bool
    data: list[Datum]


# No dimension of a tensor, and no densified sparse tensor, is larger (dense data is bounded by the body).
MAX_DENSE_VALUES = 1 << 24

_NUMPY_DTYPES = {pb.DTYPE_FLOAT32: np.dtype(np.float32), pb.DTYPE_INT64: np.dtype(np.int64),
                 pb.DTYPE_INT32: np.dtype(np.int32), pb.DTYPE_BFLOAT16: np.dtype(np.uint16)}  # bf16: raw bits
_PROTO_DTYPES = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
_OTHER_MODALITIES = {"image": "an image", "image_asset_pointer": "an image", "dmel": "an audio (dmel)"}


# ---------------------------------------------------------------------------- forward_backward in

def decode_forward_backward(body: bytes, max_values: int = MAX_DENSE_VALUES) -> ForwardBackwardCall:
    """A ForwardBackwardRequest protobuf as plexrl types; WireError naming what does not fit.
    `max_values` bounds the request's tokens and tensor values in all, counted from the
    encoded sizes and shapes before any of them is converted or densified."""
    message = _parse(pb.ForwardBackwardRequest, body, "forward_backward body")
    values = request_values(message)
    if values > max_values:
        raise WireError(f"forward_backward holds {values:,} tokens and tensor values in all ({len(message.data)} "
                        f"datums); expected at most {max_values:,} in one request: split it into smaller ones")
    if not message.model_id:
        raise WireError("forward_backward: model_id is empty; expected the model_id create_model answered")
    if message.seq_id < 1:
        raise WireError(f"forward_backward: seq_id={message.seq_id}; expected an integer >= 1 "
                        "(a training client numbers its calls from 1)")
    if not message.loss_fn:
        raise WireError("forward_backward: loss_fn is empty; expected a loss name such as 'cross_entropy'")
    data = [_datum(datum, f"forward_backward: data[{i}]") for i, datum in enumerate(message.data)]
    return ForwardBackwardCall(message.model_id, message.seq_id, message.loss_fn, _loss_fn_config(message),
                               message.forward_only, data)


def request_values(message) -> int:
    """Tokens and tensor values a ForwardBackwardRequest decodes to: token bytes over 4, each
    tensor's shape product (its encoded size when it has no shape)."""
    total = 0
    for datum in message.data:
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") == "encoded_text":
                total += len(chunk.encoded_text.tokens) // 4
        for tensor in datum.loss_fn_inputs.values():
            if tensor.shape:
                total += math.prod(max(0, size) for size in tensor.shape)
            else:
                total += len(tensor.dense) // max(1, _NUMPY_DTYPES.get(tensor.dtype, np.dtype(np.uint8)).itemsize)
    return total


def _parse(kind: type, body: Any, what: str):
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise WireError(f"{what} is a {type(body).__name__}; expected protobuf bytes")
    message = kind()
    try:
        message.ParseFromString(bytes(body))
    except (DecodeError, ValueError) as exc:  # ValueError: invalid UTF-8 in a string field
        raise WireError(f"{what} ({len(body)} bytes) is not a {kind.__name__} protobuf ({exc}); expected the "
                        "bytes the Tinker SDK sends as application/x-protobuf") from None
    return message


def _loss_fn_config(message) -> dict[str, float | str]:
    """loss_fn_config_v2 (numbers and text) when set, else the legacy float map (the SDK writes both)."""
    if not message.loss_fn_config_v2:
        return dict(message.loss_fn_config)
    config = {}
    for key, value in message.loss_fn_config_v2.items():
        arm = value.WhichOneof("value")
        if arm is None:
            raise WireError(f"forward_backward: loss_fn_config_v2[{shown(key)}] holds neither a number nor text; "
                            "expected one of them")
        config[key] = getattr(value, arm)
    return config


def _datum(message, where: str) -> Datum:
    chunks = tuple(_chunk(chunk, f"{where}.model_input[{j}]") for j, chunk in enumerate(message.model_input))
    inputs = {name: _tensor(tensor, f"{where}.loss_fn_inputs[{shown(name)}]")
              for name, tensor in message.loss_fn_inputs.items()}
    return Datum(ModelInput(chunks), inputs)


def _chunk(message, where: str) -> EncodedTextChunk:
    kind = message.WhichOneof("chunk")
    if kind == "encoded_text":
        tokens = _packed(message.encoded_text.tokens, np.dtype(np.int32), f"{where}.encoded_text.tokens")
        return EncodedTextChunk(tuple(tokens.tolist()))
    if kind is None:
        raise WireError(f"{where} is an empty chunk; expected an encoded_text chunk of int32 token ids")
    raise WireError(f"{where} is {_OTHER_MODALITIES.get(kind, repr(kind))} chunk; plexrl serves text models "
                    "only, expected encoded_text chunks of token ids")


def _packed(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireError(f"{where} has {len(raw)} bytes, not a multiple of {dtype.itemsize}; "
                        f"expected packed {dtype.name} values")
    return np.frombuffer(raw, dtype=dtype)


def _tensor(message, where: str) -> TensorData:
    dtype = _NUMPY_DTYPES.get(message.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype {_dtype_name(message.dtype)}; expected DTYPE_FLOAT32, DTYPE_INT64, "
                        "DTYPE_INT32 or DTYPE_BFLOAT16")
    shape = tuple(message.shape)
    if any(not 0 <= size <= MAX_DENSE_VALUES for size in shape):
        raise WireError(f"{where}: shape {list(shape)}; expected sizes from 0 to {MAX_DENSE_VALUES}")
    if message.WhichOneof("encoding") == "sparse_csr":
        array = _densified(message.sparse_csr, dtype, shape, where)
    else:  # dense; an encoder may leave an empty dense field out altogether
        array = _packed(message.dense, dtype, f"{where}.dense")
        if shape and array.size != math.prod(shape):
            raise WireError(f"{where}: {array.size} {dtype.name} values do not fit shape {list(shape)}; "
                            f"expected {math.prod(shape)} values")
        try:
            array = array.reshape(shape) if len(shape) > 1 else array
        except ValueError:  # numpy refuses shapes whose non-zero sizes multiply past its limit
            raise WireError(f"{where}: shape {list(shape)} is too large for numpy; expected a real tensor's shape") from None
    if message.dtype == pb.DTYPE_BFLOAT16:  # the upper 16 bits of a float32
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return TensorData.from_numpy(array)


def _densified(csr, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise WireError(f"{where}: a sparse_csr tensor of shape {list(shape)}; expected a 2-D shape [rows, columns]")
    rows, columns = shape
    if rows * columns > MAX_DENSE_VALUES:
        raise WireError(f"{where}: sparse_csr shape {list(shape)} densifies to {rows * columns} values; "
                        f"expected at most {MAX_DENSE_VALUES}")
    values = _packed(csr.values, dtype, f"{where}.sparse_csr.values")
    crow = _packed(csr.crow_indices, np.dtype(np.int64), f"{where}.sparse_csr.crow_indices")
    col = _packed(csr.col_indices, np.dtype(np.int64), f"{where}.sparse_csr.col_indices")
    if crow.size != rows + 1 or crow[0] != 0 or (np.diff(crow) < 0).any() or crow[-1] != values.size:
        raise WireError(f"{where}: sparse_csr crow_indices {shown(crow.tolist())}; expected {rows + 1} "
                        f"non-decreasing row pointers from 0 to the number of values ({values.size})")
    if col.size != values.size:
        raise WireError(f"{where}: sparse_csr has {col.size} col_indices for {values.size} values; "
                        "expected one column index per value")
    if col.size and (col.min() < 0 or col.max() >= columns):
        raise WireError(f"{where}: sparse_csr col_indices {shown(col.tolist())}; expected columns in [0, {columns})")
    cells = np.repeat(np.arange(rows, dtype=np.int64), np.diff(crow)) * columns + col
    if np.unique(cells).size != cells.size:
        raise WireError(f"{where}: sparse_csr lists a (row, column) cell twice; expected each cell at most once")
    dense = np.zeros(rows * columns, dtype=dtype)
    dense[cells] = values
    return dense.reshape(rows, columns)


def _dtype_name(value: int) -> str:
    try:
        return f"{pb.DType.Name(value)} ({value})"
    except ValueError:
        return f"{value} (not a DType)"


# ---------------------------------------------------------------------------- results out

def encode_forward_backward_output(output: ForwardBackwardOutput) -> bytes:
    """A ForwardBackwardOutput protobuf: one ArrayRecord per run of datums whose output fields share
    dtype and trailing shape (one in all for plexrl's losses), and the metrics in Tinker's form.

    A field some datums lack is left out for all (value_mse gives `logprobs` only to datums with
    `target_tokens`): a BatchedTensor cannot say that one datum has none. A 0-d tensor goes out as
    shape (1,); a zero-sized trailing dimension is refused (the SDK infers the first dimension
    from the element count, so it could not be read back)."""
    if not isinstance(output, ForwardBackwardOutput):
        raise WireError(f"forward_backward output {shown(output)}; expected a plexrl ForwardBackwardOutput")
    rows = [_output_arrays(fields, f"loss_fn_outputs[{i}]") for i, fields in enumerate(output.loss_fn_outputs)]
    shared = sorted(set.intersection(*(set(row) for row in rows))) if rows else []
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=tinker_metrics(output.metrics))
    for _, run in groupby(rows, key=lambda row: [(name, row[name].dtype, row[name].shape[1:]) for name in shared]):
        run = list(run)
        record = message.loss_fn_outputs.add(num_datums=len(run))
        for name in shared:
            arrays = [row[name] for row in run]
            record.fields[name].CopyFrom(pb.BatchedTensor(
                data=b"".join(array.tobytes() for array in arrays),
                offsets=np.cumsum([0] + [array.nbytes for array in arrays], dtype=np.int64).tobytes(),
                dtype=_PROTO_DTYPES[arrays[0].dtype.name], trailing_shape=arrays[0].shape[1:]))
    return message.SerializeToString()


def _output_arrays(fields: Any, where: str) -> dict[str, np.ndarray]:
    if not isinstance(fields, Mapping):
        raise WireError(f"{where}={shown(fields)}; expected a dict of name -> TensorData")
    arrays = {}
    for name, tensor in fields.items():
        if not isinstance(name, str) or not isinstance(tensor, TensorData) or tensor.dtype not in ("float32", "int64"):
            raise WireError(f"{where}[{shown(name)}]={shown(tensor)}; expected a TensorData of dtype 'float32' or 'int64'")
        try:
            array = np.ascontiguousarray(tensor.to_numpy())
        except (TypeError, ValueError, OverflowError) as exc:
            raise WireError(f"{where}[{shown(name)}] does not convert to an array ({exc}); expected numbers that fit "
                            f"its shape {tensor.shape}") from None
        if array.ndim > 1 and 0 in array.shape[1:]:
            raise WireError(f"{where}[{shown(name)}] has shape {array.shape}; expected no zero-sized dimension after "
                            "the first (the SDK could not tell the first dimension back)")
        arrays[name] = array.reshape(1) if array.ndim == 0 else array
    return arrays


def encode_sample_response(response: SampleResponse) -> bytes:
    """A SampleResponse protobuf: per sequence int32 tokens, float32 logprobs and a stop reason;
    prompt logprobs (when asked for) float32 with NaN for None."""
    if not isinstance(response, SampleResponse):
        raise WireError(f"sample response {shown(response)}; expected a plexrl SampleResponse")
    message = pb.SampleResponse()
    for i, sequence in enumerate(response.sequences):
        where = f"sequences[{i}]"
        if not isinstance(sequence, SampledSequence):
            raise WireError(f"{where}={shown(sequence)}; expected a SampledSequence")
        stop_reason = _STOP_REASONS.get(sequence.stop_reason) if isinstance(sequence.stop_reason, str) else None
        if stop_reason is None:
            raise WireError(f"{where}.stop_reason={shown(sequence.stop_reason)}; expected 'stop' or 'length'")
        tokens = _int32s(sequence.tokens, f"{where}.tokens")
        logprobs = _float32s(sequence.logprobs, f"{where}.logprobs")
        if logprobs.size != tokens.size:
            raise WireError(f"{where} has {tokens.size} tokens and {logprobs.size} logprobs; expected one logprob per token")
        message.sequences.add(stop_reason=stop_reason, tokens=tokens.tobytes(), logprobs=logprobs.tobytes())
    if response.prompt_logprobs is not None:
        values = response.prompt_logprobs
        if isinstance(values, (list, tuple)):
            values = [math.nan if value is None else value for value in values]
        message.prompt_logprobs = _float32s(values, "prompt_logprobs").tobytes()
    return message.SerializeToString()


def _int32s(values: Any, where: str) -> np.ndarray:
    array = _numbers(values, where, "a flat list of integer token ids")
    if array.size and (array.dtype.kind not in "iu" or array.min() < np.iinfo(np.int32).min
                       or array.max() > np.iinfo(np.int32).max):
        raise WireError(f"{where}={shown(values)}; expected integer token ids that fit int32")
    return array.astype(np.int32)


def _float32s(values: Any, where: str) -> np.ndarray:
    return _numbers(values, where, "a flat list of numbers").astype(np.float32)


def _numbers(values: Any, where: str, expected: str) -> np.ndarray:
    """`values` (a list, tuple or 1-D numpy array of numbers, never bools) as an array."""
    if isinstance(values, np.ndarray):
        numbers = values.ndim == 1 and values.dtype.kind in "iuf"
    else:
        numbers = isinstance(values, (list, tuple)) and all(
            isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values)
    if not numbers:
        raise WireError(f"{where}={shown(values)}; expected {expected}")
    return np.asarray(values)


# ---------------------------------------------------------------------------- metrics

REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")  # the SDK's REDUCE_MAP
# The reduction each of plexrl's bare metric names means. forward_backward's loss is a sum over
# tokens (backends/losses.py), so a call split into chunks adds them up; optim_step's (runtime/
# checkpoint.py adam_step) describe the one step.
METRIC_REDUCTIONS = {"loss": "sum", "grad_norm": "mean", "step": "max", "learning_rate": "mean"}


def tinker_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """plexrl metrics with Tinker's `name:reduction` keys, which the SDK splits at their one colon.

    A key already of that form passes unchanged. Any other key has its colons replaced by '/' and
    gets the reduction METRIC_REDUCTIONS gives its name, else `mean`: loss -> loss:sum, grad_norm ->
    grad_norm:mean, step -> step:max, learning_rate -> learning_rate:mean, reward -> reward:mean,
    a:b:c -> a/b/c:mean. Where two keys land on one, the one given in Tinker's form wins, else the
    first."""
    if not isinstance(metrics, Mapping):
        raise WireError(f"metrics={shown(metrics)}; expected a dict of name -> number")
    converted: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key or isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise WireError(f"metric {shown(key)}={shown(value)}; expected a non-empty str name and a number")
        if _is_tinker_metric(key):
            converted[key] = float(value)
    for key, value in metrics.items():
        if not _is_tinker_metric(key):
            name = key.replace(":", "/")
            converted.setdefault(f"{name}:{METRIC_REDUCTIONS.get(name, 'mean')}", float(value))
    return converted


def _is_tinker_metric(key: str) -> bool:
    name, colon, reduction = key.partition(":")
    return bool(name) and bool(colon) and reduction in REDUCTIONS


# ---------------------------------------------------------------------------- JSON bodies

def adam_params(body: Mapping[str, Any]) -> AdamParams:
    """optim_step's `adam_params` object as plexrl AdamParams (a missing field takes the default).

    Tinker's six fields are plexrl's, with the same meanings and defaults (tests assert it), so
    nothing is dropped: grad_clip_norm 0.0 means no clipping in both; a negative one is refused."""
    given = _fields(body, "adam_params", tinker_types.AdamParams.model_fields)
    return _validated(AdamParams(**given), "adam_params")


def sampling_params(body: Mapping[str, Any]) -> SamplingParams:
    """asample's `sampling_params` object as plexrl SamplingParams, `stop` as a tuple.

    A missing or null max_tokens (Tinker: the server's choice) takes plexrl's default,
    SamplingParams().max_tokens. `stop` stays None when absent and () when [] (Tinker: [] also
    turns off stopping at EOS; None keeps it), so the server can tell the two apart."""
    given = _fields(body, "sampling_params", tinker_types.SamplingParams.model_fields)
    if given.get("max_tokens") is None:
        given.pop("max_tokens", None)
    stop = given.get("stop")
    if isinstance(stop, (list, tuple)):
        if len({isinstance(s, str) for s in stop}) > 1:
            raise WireError(f"sampling_params.stop={shown(stop)} mixes strings and token ids; expected a string, "
                            "a list of strings or a list of token ids")
        given["stop"] = tuple(stop)
    return _validated(SamplingParams(**given), "sampling_params")


def model_input(body: Mapping[str, Any], what: str = "model_input") -> ModelInput:
    """A ModelInput from its JSON form `{"chunks": [{"type": "encoded_text", "tokens": [...]}, ...]}`
    (an asample's `prompt`); `what` names it in errors."""
    given = _fields(body, what, tinker_types.ModelInput.model_fields)
    if "chunks" not in given:
        raise WireError(f"{what} has no chunks; expected {{'chunks': [{{'type': 'encoded_text', 'tokens': [...]}}]}}")
    chunks = given["chunks"]
    if not isinstance(chunks, (list, tuple)):
        raise WireError(f"{what}.chunks={shown(chunks)}; expected a list of chunks")
    return ModelInput(tuple(_json_chunk(chunk, f"{what}.chunks[{j}]") for j, chunk in enumerate(chunks)))


def _json_chunk(chunk: Any, where: str) -> EncodedTextChunk:
    kind = chunk.get("type", "encoded_text") if isinstance(chunk, Mapping) else None
    if kind in _OTHER_MODALITIES:
        raise WireError(f"{where} is {_OTHER_MODALITIES[kind]} chunk; plexrl serves text models only, expected "
                        "encoded_text chunks of token ids")
    if kind != "encoded_text":
        raise WireError(f"{where}={shown(chunk)}; expected {{'type': 'encoded_text', 'tokens': [token ids]}}")
    given = _fields(chunk, where, tinker_types.EncodedTextChunk.model_fields)
    if "tokens" not in given:
        raise WireError(f"{where} has no tokens; expected a list of token ids")
    try:
        return EncodedTextChunk(token_ids(given["tokens"], where))
    except errors.InvalidInput as exc:
        raise WireError(str(exc)) from None


def _fields(body: Any, what: str, known: Mapping[str, Any]) -> dict[str, Any]:
    """`body` as a dict, WireError if it is not an object or has fields the SDK's type lacks."""
    if not isinstance(body, Mapping):
        raise WireError(f"{what}={shown(body)}; expected a JSON object with fields from {sorted(known)}")
    unknown = sorted(map(str, set(body) - set(known)))
    if unknown:
        raise WireError(f"{what} has unknown fields {unknown}; expected fields from {sorted(known)}")
    return dict(body)


def _validated(params, what: str):
    try:
        params.validate()
    except errors.InvalidInput as exc:
        raise WireError(f"{what}: {exc}") from None
    return params.plain()
