"""Execution of the function API on one Hugging Face causal LM: the real backend's core.

These are pure functions of (model, arguments): the runtime owns scheduling, memory and where
the model's tensors live; this module only runs it. Conventions are Tinker's:
- a datum's `loss_fn_inputs` each have the length of its `model_input`, and `target_tokens[t]` is
  the token that follows input position t;
- losses are sums over tokens (see backends/losses.py);
- `sample` returns each sequence's tokens, their log-probs and a stop reason; `sample_batch`
  decodes many requests at once, each row bitwise as it would be alone (slot_decode.py).
Inputs are checked with plexrl/api/validation.py, the checks a job's client already ran, so a
direct call fails the same way as one through a cluster.

Invariants:
- `forward_backward` accumulates gradients into the `p.grad` tensors already there, in place: it
  never assigns, replaces or zeroes `p.grad` (the runtime presets them as views into its arena
  and zeroes them after optim_step). With `backward=False` no autograd graph is built.
- Mixed precision (`autocast=torch.bfloat16`): the model's forward and the loss run under
  `torch.autocast`, the backward outside it (gradients land in the parameters' own dtype, float32
  master weights get float32 gradients); log-probs are computed in float32 whatever the model's
  dtype. Without it, the model runs in its parameters' dtype.
- Nothing reads or changes global state: no global RNG (sampling draws from a hash of the
  caller's seed, slot_decode.py), no `model.train()`/`eval()` switch, no default dtype; `sample`
  runs the model with eager attention and puts its attention setting back when it returns.
  Same weights + same arguments (seed included) -> same result, whatever else runs in the process.
- A datum's results do not depend on the other datums of its batch beyond float noise: batches
  are right-padded, so with causal attention real positions never see a pad.
- `sample`'s log-probs at temperature 1 are those `compute_logprobs` gives on prompt+completion.
- A non-finite update never reaches the gradients: `forward_backward` refuses a non-finite loss
  before backward, and gradients that come out non-finite (or whose norm overflows float32) after
  it, with `errors.NonFiniteUpdate`, every `p.grad` put back bitwise as it was. The checks only
  read: the arithmetic of a good call is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from plexrl import errors, types
from plexrl.api import validation
from plexrl.backends import losses, slot_decode
from plexrl.types import Datum

CustomLoss = Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
Decode = Callable[[list[int]], str]
PAD_TOKEN_ID = 0


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def model_limits(model: torch.nn.Module, max_positions: int | None) -> tuple[int, int]:
    """(vocab_size, max_positions); max_positions defaults to the model's position embeddings."""
    config = model.config
    return config.vocab_size, max_positions or config.max_position_embeddings


def mixed(model: torch.nn.Module, autocast: torch.dtype | None):
    """`torch.autocast` to `autocast` on the model's device type, or nothing when None."""
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(model_device(model).type, dtype=autocast)


def with_cache(model: torch.nn.Module, cache: DynamicCache) -> dict:
    """The KV-cache keyword of `model.forward`: `cache` in transformers >= 5.2x, else `past_key_values`."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


# ---------------------------------------------------------------------------- forward_backward

@dataclass(frozen=True)
class Batch:
    """Datums right-padded into (B, T) tensors."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor  # 1 on real positions, 0 on pads
    target_tokens: torch.Tensor  # PAD_TOKEN_ID where a datum gives none (and on pads)
    lengths: list[int]

    @property
    def mask(self) -> torch.Tensor:
        return self.attention_mask.bool()


def pad_batch(datums: Sequence[Datum], device: torch.device) -> Batch:
    lengths = [d.model_input.length for d in datums]
    input_ids = torch.full((len(datums), max(lengths)), PAD_TOKEN_ID, dtype=torch.long)
    targets = torch.full_like(input_ids, PAD_TOKEN_ID)
    attention_mask = torch.zeros_like(input_ids)
    for row, (datum, length) in enumerate(zip(datums, lengths)):
        input_ids[row, :length] = torch.tensor(datum.model_input.to_ints())
        attention_mask[row, :length] = 1
        if "target_tokens" in datum.loss_fn_inputs:
            targets[row, :length] = torch.from_numpy(datum.loss_fn_inputs["target_tokens"].to_numpy().astype("int64"))
    return Batch(input_ids.to(device), attention_mask.to(device), targets.to(device), lengths)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per position, computed in float32 whatever the model dtype."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def per_datum(batch: Batch, padded: torch.Tensor) -> list[torch.Tensor]:
    return [padded[row, :length] for row, length in enumerate(batch.lengths)]


def forward_backward(model: torch.nn.Module, datums: Sequence[Datum], loss_fn: str | CustomLoss,
                     loss_fn_config: dict | None = None, *, backward: bool = True,
                     max_positions: int | None = None,
                     autocast: torch.dtype | None = None) -> types.ForwardBackwardOutput:
    """Loss over `datums` (sum over tokens); with `backward`, its gradient added into `p.grad`.

    `loss_fn` is a built-in loss name or a custom callable `fn(datums, logprobs) -> (loss, metrics)`
    where `logprobs[i]` is datum i's per-token target log-probs (with grad). Outputs per datum:
    `logprobs` (when the datum has `target_tokens`) and, for `value_mse`, `values`.
    """
    datums = list(datums)
    vocab_size, max_positions = model_limits(model, max_positions)
    validation.validate_datums(datums, vocab_size, max_positions)
    run = prepare_loss(loss_fn, loss_fn_config, datums)  # every input error is raised before running
    batch = pad_batch(datums, model_device(model))
    with torch.enable_grad() if backward else torch.no_grad(), mixed(model, autocast):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        total, outputs, metrics = run(batch, logits)
    loss = float(total.detach())
    if backward:
        if not math.isfinite(loss):
            raise errors.NonFiniteUpdate(nonfinite_message("the loss is non-finite", loss_fn, loss, datums))
        checked_backward(model, total, lambda what: nonfinite_message(what, loss_fn, loss, datums))
    metrics = {**metrics, "loss:sum": loss}
    return types.ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)


# Gradients whose norm reaches this are refused: a float32 norm of many elements overflows near
# sqrt(float32 max) ~ 1.8e19, and optim_step's norm of the whole gradient must stay finite.
GRAD_NORM_LIMIT = 2.0 ** 62


def checked_backward(model: torch.nn.Module, total: torch.Tensor, message: Callable[[str], str]) -> None:
    """`total.backward()`, refused with NonFiniteUpdate if the gradients it leaves are non-finite or
    their norm reaches GRAD_NORM_LIMIT; then every `p.grad` is put back bitwise as it was.

    Cost on a good call: one read of the gradients before backward (are they all zero?) and one
    after (their norm), one device sync each. Only when the call accumulates onto non-zero
    gradients (several forward_backward calls before an optim_step) is a copy of them kept for the
    duration of the backward: 4 bytes per parameter, on the gradients' device, outside the arena.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.grad for p in params]
    present = [g for g in before if g is not None]
    backup = [g.clone() for g in present] if any_nonzero(present) else None
    total.backward()  # AccumulateGrad adds into existing p.grad in place (grad mode is off)
    grads = [p.grad for p in params if p.grad is not None]
    norm = float(grad_norm(grads))
    if norm < GRAD_NORM_LIMIT:
        return
    elements_finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
    copies = iter(backup or ())
    for p, old in zip(params, before):
        if old is not None and backup is not None:
            old.copy_(next(copies))
        elif old is not None:
            old.zero_()  # every bit was zero: exact
        p.grad = old
    what = (f"its gradients are non-finite (norm {norm})" if not elements_finite
            else f"its gradient norm ({norm:.3g}) overflows float32 (limit {GRAD_NORM_LIMIT:.3g})")
    raise errors.NonFiniteUpdate(message(what))


def any_nonzero(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any element of `tensors` has a bit set (-0.0 counts: restoring it by zeroing would not be exact)."""
    if not tensors:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    # count_nonzero of the bits: several times faster than a boolean any() on CPU
    return bool(torch.stack([torch.count_nonzero(t.view(ints[t.element_size()])) for t in tensors]).any())


def grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `grads` together: NaN or inf when any element is."""
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def nonfinite_message(what: str, loss_fn: str | CustomLoss, loss: float, datums: Sequence[Datum]) -> str:
    """Why forward_backward refused, the loss, the extreme input and what to check (built only on refusal)."""
    if isinstance(loss_fn, str):
        hint = ("check the loss_fn_inputs for NaN/inf or extreme values: a sampler log-prob far below the "
                "model's overflows the ratio exp(lp - logprobs) (beyond ~88 nats), and advantages or weights "
                "near float32's limit (3.4e38) overflow the loss or its gradient")
        name = repr(loss_fn)
    else:
        hint = ("check the custom loss for log(0), division by zero, sqrt at 0 or overflowing exp, and its "
                "inputs for NaN/inf")
        name = f"custom {getattr(loss_fn, '__name__', loss_fn)!r}"
    return (f"forward_backward refused: {what} (loss_fn={name}, loss {loss}); no gradient was added and the "
            f"model is as it was before the call. {extreme_inputs(datums)}; {hint}")


def extreme_inputs(datums: Sequence[Datum]) -> str:
    """The most extreme value of each float loss_fn_input (a non-finite one first) and its datum."""
    worst: dict[str, tuple[float, float, int]] = {}  # key -> (score, value, datum index)
    for index, datum in enumerate(datums):
        for key, data in datum.loss_fn_inputs.items():
            if key == "target_tokens":
                continue
            values = np.asarray(data.to_numpy(), dtype=np.float64).reshape(-1)
            if values.size == 0:
                continue
            bad = ~np.isfinite(values)
            at = int(np.argmax(bad)) if bad.any() else int(np.argmax(np.abs(values)))
            score = math.inf if bad.any() else abs(float(values[at]))
            if key not in worst or score > worst[key][0]:
                worst[key] = (score, float(values[at]), index)
    if not worst:
        return "The datums have no float loss_fn_inputs"
    return "Most extreme inputs: " + ", ".join(
        f"{key} {value:.3g} (datum {index})" for key, (_, value, index) in sorted(worst.items()))


def prepare_loss(loss_fn: str | CustomLoss, loss_fn_config: dict | None, datums: list[Datum]):
    """Checked loss as `run(batch, logits) -> (total loss, per-datum outputs, metrics)`."""
    checked = validation.check_loss(loss_fn, loss_fn_config, datums)
    if checked is None:
        return functools.partial(custom_loss, loss_fn, datums)
    return functools.partial(builtin_loss, *checked, datums)


def builtin_loss(loss: validation.LossSpec, config: dict, datums: list[Datum], batch: Batch,
                 logits: torch.Tensor):
    """(total loss, per-datum outputs, metrics) for a built-in loss."""
    logprobs = target_logprobs(logits, batch.target_tokens)
    values = logits[..., losses.VALUE_TOKEN_ID].float()
    inputs = losses.padded_inputs(loss, datums, batch.input_ids.shape[1], logits.device)
    model_output = logprobs if loss.reads == "logprobs" else values
    total = losses.loss_sum(loss, model_output, inputs, batch.mask, config)
    outputs = [{} for _ in datums]
    for row, datum in enumerate(datums):
        if "target_tokens" in datum.loss_fn_inputs:
            outputs[row]["logprobs"] = types.TensorData.of(logprobs[row, :batch.lengths[row]])
        if loss.reads == "values":
            outputs[row]["values"] = types.TensorData.of(values[row, :batch.lengths[row]])
    return total, outputs, {}


def custom_loss(fn: CustomLoss, datums: list[Datum], batch: Batch, logits: torch.Tensor):
    """(total loss, per-datum outputs, metrics) for a user loss over per-datum log-probs."""
    logprobs = per_datum(batch, target_logprobs(logits, batch.target_tokens))
    result = fn(datums, logprobs)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
            and result[0].numel() == 1 and isinstance(result[1], dict)):
        raise errors.InvalidInput(
            f"custom loss {getattr(fn, '__name__', fn)!r} returned {type(result).__name__}; "
            "expected a tuple (scalar loss tensor, metrics dict)")
    total, metrics = result
    if torch.is_grad_enabled() and not total.requires_grad:
        raise errors.InvalidInput(
            f"custom loss {getattr(fn, '__name__', fn)!r} returned a loss with no gradient; "
            "expected a function of the logprobs it was given")
    outputs = [{"logprobs": types.TensorData.of(lp)} for lp in logprobs]
    return total.reshape(()), outputs, {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------------- compute_logprobs

def compute_logprobs(model: torch.nn.Module, tokens: Sequence[int], *,
                     max_positions: int | None = None, autocast: torch.dtype | None = None) -> list[float | None]:
    """Log-prob of each token given the ones before it; the first has no context, so None."""
    tokens = [int(t) for t in tokens]
    vocab_size, max_positions = model_limits(model, max_positions)
    validation.check_sequence(tokens, vocab_size, max_positions, "compute_logprobs sequence")
    input_ids = torch.tensor([tokens], device=model_device(model))
    with torch.no_grad(), mixed(model, autocast):
        logits = model(input_ids=input_ids).logits
    return [None] + following_logprobs(logits[0], input_ids[0])


def following_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> list[float]:
    """For logits (T, V) of a sequence `tokens` (T,): log-prob of tokens[1:] given their prefix."""
    return target_logprobs(logits[:-1], tokens[1:]).tolist()


# ---------------------------------------------------------------------------- sample

@dataclass(frozen=True)
class StopRule:
    """When a sequence ends: on a token of `token_ids`, or once its text contains a string of
    `strings` (needs `decode`). The stopping token is kept in the sequence."""

    token_ids: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()
    decode: Decode | None = None

    @classmethod
    def of(cls, stop: Sequence[int] | Sequence[str] | None, stop_token_ids: Sequence[int],
           decode: Decode | None) -> "StopRule":
        stop = tuple(stop or ())
        strings = tuple(s for s in stop if isinstance(s, str))
        token_ids = tuple(int(t) for t in stop_token_ids) + tuple(t for t in stop if not isinstance(t, str))
        if strings and decode is None:
            raise errors.InvalidSamplingParams(
                f"stop strings {list(strings)} need a tokenizer to be matched; pass decode=, "
                "or give stop token ids")
        if any(not s for s in strings):
            raise errors.InvalidSamplingParams("stop strings must be non-empty")
        return cls(token_ids, strings, decode)

    def hits(self, history: list[torch.Tensor], active: torch.Tensor) -> torch.Tensor:
        """Which active rows stop at this step; `history[-1]` (N,) holds this step's tokens."""
        stop_ids = torch.tensor(self.token_ids, dtype=torch.long, device=active.device)
        stopped = active & torch.isin(history[-1], stop_ids)
        if self.strings:
            # Strings need text, so this loops over the rows still running; token ids never do.
            so_far = torch.stack(history, 1)
            for row in torch.nonzero(active & ~stopped).flatten().tolist():
                text = self.decode(so_far[row].tolist())
                stopped[row] = any(s in text for s in self.strings)
        return stopped


def choose_tokens(logits: torch.Tensor, params: types.SamplingParams,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its log-prob under softmax(logits / T) (softmax(logits) if greedy).

    Temperature first, then top-k, then top-p restrict what can be drawn; the log-prob reported
    is under the untruncated tempered distribution, so at T=1 it is the model's own log-prob.
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    allowed = top_p_filter(top_k_filter(scaled, params.top_k), params.top_p)
    tokens = torch.multinomial(torch.softmax(allowed, -1), 1, generator=generator).squeeze(-1)
    return tokens, torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """-inf outside each row's k largest logits (ties with the k-th are kept); -1 = no limit."""
    if top_k == -1 or top_k >= logits.shape[-1]:
        return logits
    kth_largest = logits.topk(top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf outside each row's nucleus: the most likely tokens whose mass first reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, -1)
    mass_before = probs.cumsum(-1) - probs  # the first token always has 0 before it: never dropped
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_request(model: torch.nn.Module, prompt: Sequence[int], num_samples: int,
                   params: types.SamplingParams, *, seed: int, stop_token_ids: Sequence[int] = (),
                   max_positions: int | None = None, decode: Decode | None = None,
                   include_prompt_logprobs: bool = False) -> slot_decode.SampleRequest:
    """One checked request for `sample_batch` (what `sample` takes, as data)."""
    prompt = [int(t) for t in prompt]
    vocab_size, max_positions = model_limits(model, max_positions)
    validation.check_sample_request(prompt, num_samples, params, vocab_size, max_positions)
    stop = StopRule.of(params.stop, stop_token_ids, decode)
    return slot_decode.SampleRequest(tuple(prompt), int(num_samples), params, int(seed), stop.token_ids,
                                     stop.strings, stop.decode, bool(include_prompt_logprobs))


def sample_batch(model: torch.nn.Module, requests: Sequence[slot_decode.SampleRequest], *,
                 max_positions: int | None = None, autocast: torch.dtype | None = None,
                 kv_tokens: int = slot_decode.DEFAULT_KV_TOKENS, graph: bool | None = None
                 ) -> tuple[list[types.SampleResponse], slot_decode.DecodeStats]:
    """Every request's response, all decoded together in one batch (backends/slot_decode.py);
    each is what `sample` alone gives it, bit for bit. `graph`: decode steps as captured CUDA
    graphs (None: on CUDA, eager elsewhere)."""
    _, max_positions = model_limits(model, max_positions)
    with mixed(model, autocast):
        return slot_decode.sample_many(model, requests, max_positions=max_positions, kv_tokens=kv_tokens,
                                       graph=graph)


def sample(model: torch.nn.Module, prompt: Sequence[int], num_samples: int,
           params: types.SamplingParams, *, seed: int, stop_token_ids: Sequence[int] = (),
           max_positions: int | None = None, decode: Decode | None = None,
           include_prompt_logprobs: bool = False, autocast: torch.dtype | None = None,
           kv_tokens: int = slot_decode.DEFAULT_KV_TOKENS) -> types.SampleResponse:
    """`num_samples` continuations of `prompt`: a batch of one request (`sample_batch`).

    Randomness comes only from `seed` (the caller picks it, e.g. from `params.seed`), through a
    counter-based hash of (seed, sample index, step). Stops: `params.stop` (token ids, or strings
    when `decode` maps token ids to text) and `stop_token_ids`; a stopped sequence ends with its
    stop token.
    """
    request = sample_request(model, prompt, num_samples, params, seed=seed, stop_token_ids=stop_token_ids,
                             max_positions=max_positions, decode=decode,
                             include_prompt_logprobs=include_prompt_logprobs)
    responses, _ = sample_batch(model, [request], max_positions=max_positions, autocast=autocast,
                                kv_tokens=kv_tokens)
    return responses[0]


def sample_eager(model: torch.nn.Module, prompt: Sequence[int], num_samples: int,
           params: types.SamplingParams, *, seed: int, stop_token_ids: Sequence[int] = (),
           max_positions: int | None = None, decode: Decode | None = None,
           include_prompt_logprobs: bool = False, autocast: torch.dtype | None = None) -> types.SampleResponse:
    """`num_samples` continuations of `prompt`, decoded together with a KV cache, one Python step
    and one host sync per token: the loop `sample` ran before batched decoding (slot_decode.py),
    kept as its reference (tests) and as the baseline of `plexrl bench sample`.

    Randomness comes only from a `torch.Generator` seeded with `seed` (the caller picks it,
    e.g. from `params.seed`). Stops: `params.stop` (token ids, or strings when `decode` maps
    token ids to text) and `stop_token_ids`; a stopped sequence ends with its stop token.
    """
    prompt = [int(t) for t in prompt]
    vocab_size, max_positions = model_limits(model, max_positions)
    validation.check_sample_request(prompt, num_samples, params, vocab_size, max_positions)
    stop = StopRule.of(params.stop, stop_token_ids, decode)
    device = model_device(model)
    generator = torch.Generator(device=device).manual_seed(int(seed))
    with torch.no_grad(), mixed(model, autocast):
        # 1) prefill the prompt once, then replicate its KV cache for every sample
        cache = DynamicCache()
        cached = with_cache(model, cache)
        prompt_ids = torch.tensor([prompt], device=device)
        out = model(input_ids=prompt_ids, **cached,
                    logits_to_keep=0 if include_prompt_logprobs else 1)  # 0 keeps every position
        prompt_logprobs = None
        if include_prompt_logprobs:
            prompt_logprobs = [None] + following_logprobs(out.logits[0], prompt_ids[0])
        cache.batch_repeat_interleave(num_samples)
        logits = out.logits[:, -1].expand(num_samples, -1)
        # 2) decode all rows in lockstep until every row stopped or max_tokens is reached
        tokens, logprobs, lengths = decode_loop(model, cached, logits, params, generator, stop)
    sequences = [
        types.SampledSequence(tokens=row_tokens[:length], logprobs=row_logprobs[:length],
                              stop_reason="stop" if stopped else "length")
        for row_tokens, row_logprobs, (length, stopped) in zip(tokens, logprobs, lengths)
    ]
    return types.SampleResponse(sequences=sequences, prompt_logprobs=prompt_logprobs)


def decode_loop(model, cached: dict, logits: torch.Tensor, params: types.SamplingParams,
                generator: torch.Generator, stop: StopRule):
    """Per row: tokens, log-probs, and (length kept, whether it ended on a stop rule).

    Rows that stopped keep being decoded (their extra tokens are cut off afterwards) so the
    batch stays rectangular and the loop has no per-row work."""
    rows = logits.shape[0]
    active = torch.ones(rows, dtype=torch.bool, device=logits.device)
    length = torch.full((rows,), params.max_tokens, dtype=torch.long, device=logits.device)
    chosen, chosen_logprobs = [], []
    for step in range(params.max_tokens):
        tokens, logprobs = choose_tokens(logits, params, generator)
        chosen.append(tokens)
        chosen_logprobs.append(logprobs)
        stopped_now = stop.hits(chosen, active)
        length[stopped_now] = step + 1
        active &= ~stopped_now
        if step + 1 == params.max_tokens or not active.any():
            break
        logits = model(input_ids=tokens[:, None], **cached).logits[:, -1]
    return (torch.stack(chosen, 1).tolist(), torch.stack(chosen_logprobs, 1).tolist(),
            list(zip(length.tolist(), (~active).tolist())))
