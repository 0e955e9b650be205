"""Batched sampling: many `sample` requests of one model decoded together in fixed-shape slots.

One call takes a list of requests (each a prompt x num_samples with its own sampling params,
seed, stop rule and log-prob options) and decodes all their rows at once, as continuous batching
does: rows sit in the slots of a static KV cache; a row that finishes frees its slot, and a
waiting row is prefilled and takes it at the next step boundary.

1) Each request's prompt is prefilled once for all its samples, together with the other prompts
   waiting for slots that have its prefill length (its own length rounded up to PREFILL_BUCKET):
   right-padded to it, attending causally to its own tokens only; its KV is copied into the
   slots of its rows, at cache positions 0..n-1.
2) A decode step runs every slot at once: choose each row's token from its logits (on the
   device), then one forward of the model over all slots, each writing its KV at its own
   position and attending over the whole static cache under its own mask.
3) The host looks at the batch only every few steps (`SYNC_STEPS`; `SYNC_STEPS_WAITING` while
   rows wait for a slot, so that a row that stopped early gives its slot up sooner; or when a
   row reaches its max_tokens): to collect finished rows, match stop strings (text needs the tokenizer) and
   admit waiting rows. Between looks no step reads anything back to the host, so on CUDA the
   steps queue without a host sync and each runs as the replay of a captured CUDA graph
   (`torch.cuda.CUDAGraph` of the eager step: the same kernels, so the same bits); the same step
   runs eagerly on CPU.

Invariants (tests/test_slot_decode.py checks them):
- Transparency: a row's tokens and log-probs depend only on its own request (prompt, params,
  seed, its sample index, stop rule), never on the other rows of the call nor on which slot it
  lands in. Every length a row meets is fixed by the row itself: its prompt is prefilled padded
  to a bucket of its own length (`prefill_len`), its cache is a bucket of its own prompt +
  max_tokens (`cache_len`), and rows of different lengths never share a forward. What varies
  with the composition is only the number of rows of a forward: at least SLOT_BUCKETS[0] in a
  decode step, at least PREFILL_BUCKET positions in a prefill; a matmul's row over those shapes
  came out the same for every such number measured here (CPU), and the test decides. Attention
  is the eager (matmul, softmax) one (PyTorch's CPU SDPA kernel is not row-invariant: a row's
  output moved with its slot, measured), and randomness a counter-based hash of (seed, sample
  index, step, token id), not a generator shared by the rows (`gumbel_noise`).
- Sampling semantics are those of `execution.sample_eager` (the one-request loop this replaces,
  kept as the reference): temperature, then top-k (ties with the k-th kept), then top-p restrict
  what may be drawn; the log-prob reported is under the untruncated tempered distribution
  (softmax(logits) when greedy); a row stops on its first stop token (kept) or stop string, else
  at max_tokens.
- The slot cache holds at most `kv_tokens` positions (slots x cache length, at least the
  smallest bucket of slots). In a cluster that is what the device's activation reserve holds
  (StateManager.decode_positions): the reserve is set aside for one function at a time, and a
  batched sample is one.

Out of scope: paged KV (a slot reserves its whole cache length), prefix sharing between
requests, speculative decoding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from plexrl import errors, types

SLOT_BUCKETS = (8, 16, 32, 64, 128, 256)  # decode batch shapes; a row's result is the same in each
CACHE_MIN = 16  # cache lengths are powers of two from this (a row's own prompt + max_tokens, rounded up)
SYNC_STEPS = 8  # decode steps between two looks of the host at the batch
SYNC_STEPS_WAITING = 2  # the same while rows wait for a slot (a row that stopped frees its slot sooner)
PREFILL_BUCKET = 16  # prompts are prefilled right-padded to a multiple of this (of their own length)
PREFILL_ROWS = 64  # prompts prefilled in one forward, at most
PAD_TOKEN_ID = 0
DEFAULT_KV_TOKENS = 256 * 64  # slots x cache length by default: 256 rows (vLLM's max_num_seqs) of 64 positions


@dataclass(frozen=True)
class SampleRequest:
    """One `sample` call: `num_samples` rows continuing `prompt`."""

    prompt: tuple[int, ...]
    num_samples: int
    params: types.SamplingParams
    seed: int
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    decode: object = None  # token ids -> text, for stop strings
    include_prompt_logprobs: bool = False

    @property
    def positions(self) -> int:
        return len(self.prompt) + self.params.max_tokens


@dataclass(frozen=True)
class DecodeStats:
    """What a batched call did, for accounting and for fitting the decode model (sim/latency.py):
    `steps` decode steps over `row_steps` live rows in all (sum over steps of the live rows),
    `prefill_tokens` prompt tokens prefilled, `tokens` per request (its rows' tokens)."""

    steps: int = 0
    row_steps: int = 0
    prefill_tokens: int = 0
    slots: tuple[int, ...] = ()  # the slot count of each group of cache length
    tokens: tuple[int, ...] = ()


def kv_bytes_per_position(config, dtype: torch.dtype) -> int:
    """Bytes one cache position (a key and a value in every layer) takes in `dtype`."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize


def cache_len(positions: int, max_positions: int) -> int:
    """The static cache length of a row needing `positions` positions: the power of two from
    CACHE_MIN that holds them (a slot wastes less than half), at most the model's positions."""
    length = CACHE_MIN
    while length < positions:
        length *= 2
    return min(max_positions, length)


def slot_count(rows: int, length: int, kv_tokens: int) -> int:
    """The smallest bucket of SLOT_BUCKETS holding `rows`, within `kv_tokens` cache positions
    (never below the smallest bucket)."""
    fits = [s for s in SLOT_BUCKETS if s * length <= kv_tokens] or [SLOT_BUCKETS[0]]
    return next((s for s in fits if s >= rows), fits[-1])


@contextlib.contextmanager
def eager_attention(model: torch.nn.Module):
    """The model's attention as plain matmul + softmax for the duration (see the module
    docstring: the fused CPU kernel is not row-invariant); its setting is put back after."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = before


# ---------------------------------------------------------------------------- the KV cache

class SlotLayer(StaticLayer):
    """A static cache layer (transformers') whose rows each write at their own position
    (`write_at`, one per slot) instead of one position shared by the batch."""

    def __init__(self, max_cache_len: int, write_at: torch.Tensor):
        super().__init__(max_cache_len)
        self.write_at = write_at

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        index = self.write_at.view(-1, 1, 1, 1).expand(-1, key_states.shape[1], 1, key_states.shape[3])
        # in the cache's dtype: under autocast a layer's keys may come out wider than the cache (rotary in float32)
        self.keys.scatter_(2, index, key_states.to(self.keys.dtype))
        self.values.scatter_(2, index.expand(-1, -1, -1, value_states.shape[3]), value_states.to(self.values.dtype))
        return self.keys, self.values


def slot_cache(model: torch.nn.Module, slots: int, length: int, write_at: torch.Tensor,
               dtype: torch.dtype) -> Cache:
    """A cache of `slots` rows x `length` positions, allocated now (zeros)."""
    config = model.config
    layers = [SlotLayer(length, write_at) for _ in range(config.num_hidden_layers)]
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    empty = torch.zeros(slots, heads, 1, head_dim, dtype=dtype, device=write_at.device)
    for layer in layers:
        layer.lazy_initialization(empty, empty)
    return Cache(layers=layers)


# ---------------------------------------------------------------------------- choosing tokens

MASK32 = (1 << 32) - 1


def as_int64(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 of the same bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), exact (no int64 overflow)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 values in [0, 2**32)."""
    x = mul32(x ^ (x >> 16), 0x7FEB352D)
    x = mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, sample: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) standard Gumbel noise, a pure function of each row's (seed, sample index,
    step) and the token id: the same bits on every device and in every batch."""
    seed_low, seed_high = seed & MASK32, (seed >> 32) & MASK32
    key = mix32(seed_low ^ mix32(seed_high ^ mix32(sample ^ mix32(step & MASK32))))
    token = torch.arange(vocab, device=seed.device, dtype=torch.long)
    bits = mix32(key[:, None] ^ mix32(token[None, :] + 0x9E3779B9 & MASK32))
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(uniform))


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           noise: torch.Tensor, filters: tuple[bool, bool] = (True, True)) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token and its log-prob, with the row's own params (temperature 0: greedy;
    top_k -1: no limit; top_p 1: no limit). Gumbel-max over the allowed tempered logits draws
    from their softmax. `filters`: whether any row has a top-k, a top-p limit (a filter no row
    needs masks nothing, so leaving it out changes no bit)."""
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    allowed = scaled
    if filters[0]:
        vocab = logits.shape[-1]
        k = torch.where((top_k < 1) | (top_k > vocab), vocab, top_k)
        kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        allowed = allowed.masked_fill(scaled < kth, float("-inf"))
    if filters[1]:
        allowed = allowed.masked_fill(nucleus_drop(allowed, top_p), float("-inf"))
    tokens = torch.where(greedy, scaled.argmax(-1), (allowed + noise).argmax(-1))
    logprobs = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def nucleus_drop(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Where each row's nucleus leaves a token out: beyond the most likely tokens whose mass
    first reaches the row's top_p (none where top_p is 1)."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(ordered, -1)
    mass_before = probs.cumsum(-1) - probs  # the first token has 0 before it: never dropped
    drop_sorted = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


# ---------------------------------------------------------------------------- the batch

@dataclass
class Row:
    request: int  # index into the call's requests
    sample: int  # its sample index within the request
    slot: int = -1
    checked: int = 0  # tokens already matched against the request's stop strings


@dataclass
class Prefilled:
    """A request whose prompt is prefilled: its KV and last logits, until its rows are placed."""

    request: SampleRequest
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor
    prompt_logprobs: list[float | None] | None
    rows: list[Row] = field(default_factory=list)


class SlotBatch:
    """The device tensors of one group's slots and the step that advances them."""

    def __init__(self, model: torch.nn.Module, slots: int, length: int, max_new: int, max_stops: int,
                 filters: tuple[bool, bool], dtype: torch.dtype, graph: bool):
        """`max_stops`: the most stop token ids a row has; `filters`: whether any row has a top-k,
        a top-p limit (fixed for the batch, so that a captured step never changes)."""
        self.model, self.slots, self.length = model, slots, length
        device = next(model.parameters()).device
        vocab = model.config.vocab_size
        long = dict(dtype=torch.long, device=device)
        self.position = torch.zeros(slots, **long)  # where each slot's next token goes
        self.token = torch.zeros(slots, **long)
        self.generated = torch.zeros(slots, **long)
        self.max_tokens = torch.ones(slots, **long)
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)
        self.row_steps = torch.zeros((), **long)  # live rows summed over the steps run
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self.seed = torch.zeros(slots, **long)
        self.sample = torch.zeros(slots, **long)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_k = torch.full((slots,), -1, **long)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.stop_ids = torch.full((slots, max(1, max_stops)), -1, **long)
        self.logits = torch.zeros(slots, vocab, dtype=torch.float32, device=device)
        self.out_tokens = torch.zeros(slots, max_new + 1, **long)  # column max_new: where finished rows write
        self.out_logprobs = torch.zeros(slots, max_new + 1, dtype=torch.float32, device=device)
        self.cache = slot_cache(model, slots, length, self.position, dtype)
        self.key_positions = torch.arange(length, device=device)
        self.filters = filters
        self.step = captured(self._step, device) if graph else self._step

    def place(self, row: Row, pending: Prefilled) -> None:
        """Put `row` into its slot: its prompt's KV, its last logits and its params."""
        request, slot = pending.request, row.slot
        n = len(request.prompt)
        for layer, keys, values in zip(self.cache.layers, pending.keys, pending.values):
            layer.keys[slot, :, :n] = keys[0]
            layer.values[slot, :, :n] = values[0]
        params = request.params
        self.logits[slot] = pending.logits
        self.position[slot], self.generated[slot], self.max_tokens[slot] = n, 0, params.max_tokens
        self.live[slot], self.stopped[slot] = True, False
        self.seed[slot], self.sample[slot] = as_int64(request.seed), row.sample
        self.temperature[slot] = params.temperature
        self.top_k[slot], self.top_p[slot] = params.top_k, params.top_p
        stops = request.stop_token_ids
        self.stop_ids[slot] = -1
        if stops:
            self.stop_ids[slot, :len(stops)] = torch.tensor(stops, dtype=torch.long)

    def _step(self) -> None:
        """One decode step of every slot, on the device: choose, record, stop, forward."""
        with torch.autocast(self.logits.device.type, enabled=False):  # the draw in float32, also in a bf16 cluster
            noise = gumbel_noise(self.seed, self.sample, self.generated, self.logits.shape[-1])
            token, logprob = choose(self.logits, self.temperature, self.top_k, self.top_p, noise, self.filters)
        self.row_steps += self.live.sum()
        column = torch.where(self.live, self.generated, self.out_tokens.shape[1] - 1)[:, None]
        self.out_tokens.scatter_(1, column, token[:, None])
        self.out_logprobs.scatter_(1, column, logprob[:, None])
        self.generated += self.live
        hit = self.live & (token[:, None] == self.stop_ids).any(-1)
        self.stopped |= hit
        self.live &= ~hit & (self.generated < self.max_tokens)
        mask = torch.where(self.key_positions[None, :] <= self.position[:, None], 0.0, float("-inf"))
        out = self.model(input_ids=token[:, None], position_ids=self.position[:, None],
                         attention_mask=mask[:, None, None, :], cache=self.cache, use_cache=True)
        self.logits.copy_(out.logits[:, -1].float())
        self.position.copy_(torch.clamp(self.position + 1, max=self.length - 1))


def captured(step, device: torch.device):
    """`step` as the replay of a CUDA graph captured once (after warm-up steps on a side stream,
    which with no live row write only into dead slots). The graph runs the very kernels `step`
    launches eagerly, so a row's bits are those of the eager step (torch.compile's fused kernels
    are not: measured on CPU, its rows differed from the eager step's)."""
    if device.type != "cuda":
        raise errors.InvalidInput(f"graph=True captures the decode step as a CUDA graph; the model is on {device}, "
                                  "expected a CUDA device (or graph=None: captured on CUDA, eager elsewhere)")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def prefill_len(prompt: int, max_positions: int) -> int:
    """The length a prompt of `prompt` tokens is prefilled at: a multiple of PREFILL_BUCKET."""
    return min(max_positions, -(-prompt // PREFILL_BUCKET) * PREFILL_BUCKET)


def prefill(model: torch.nn.Module, requests: list[SampleRequest], length: int) -> list[Prefilled]:
    """Prefill `requests` (prompts of prefill length `length`) in one forward: right-padded to
    `length`, each row attending causally to its own prompt only (eager attention, so the row
    depends on its own tokens and the fixed length, never on the other rows)."""
    device = next(model.parameters()).device
    ids = torch.full((len(requests), length), PAD_TOKEN_ID, dtype=torch.long)
    for row, request in enumerate(requests):
        ids[row, :len(request.prompt)] = torch.tensor(request.prompt)
    ids = ids.to(device)
    lengths = torch.tensor([len(r.prompt) for r in requests], device=device)
    positions = torch.arange(length, device=device)
    allowed = (positions[None, None, :] <= positions[None, :, None]) & (positions[None, None, :] < lengths[:, None, None])
    mask = torch.where(allowed, 0.0, float("-inf"))[:, None]  # (rows, 1, query, key)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions[None].expand(len(requests), -1),
                cache=cache, use_cache=True)
    logits = out.logits.float()
    pending = []
    for row, request in enumerate(requests):
        n = len(request.prompt)
        prompt_logprobs = None
        if request.include_prompt_logprobs:
            following = torch.log_softmax(logits[row, :n - 1], -1).gather(-1, ids[row, 1:n, None]).squeeze(-1)
            prompt_logprobs = [None] + following.tolist()
        keys = [layer.keys[row:row + 1, :, :n] for layer in cache.layers]
        values = [layer.values[row:row + 1, :, :n] for layer in cache.layers]
        pending.append(Prefilled(request, keys, values, logits[row, n - 1], prompt_logprobs))
    return pending


def prefill_waiting(model: torch.nn.Module, requests: Sequence[SampleRequest], wanted: list[int],
                    max_positions: int, prefilled: dict) -> int:
    """Prefill the requests `wanted` (indices), grouped by prefill length, into `prefilled`;
    the prompt tokens prefilled."""
    groups: dict[int, list[int]] = {}
    for i in wanted:
        groups.setdefault(prefill_len(len(requests[i].prompt), max_positions), []).append(i)
    for length, indices in sorted(groups.items()):
        for start in range(0, len(indices), PREFILL_ROWS):
            chunk = indices[start:start + PREFILL_ROWS]
            for i, pending in zip(chunk, prefill(model, [requests[i] for i in chunk], length)):
                prefilled[i] = pending
    return sum(len(requests[i].prompt) for i in wanted)


def stop_string_at(request: SampleRequest, tokens: list[int], checked: int) -> int | None:
    """The first length beyond `checked` at which the text of `tokens` contains a stop string."""
    for length in range(checked + 1, len(tokens) + 1):
        text = request.decode(tokens[:length])
        if any(s in text for s in request.stop_strings):
            return length
    return None


def sample_group(model: torch.nn.Module, requests: Sequence[SampleRequest], indices: list[int], length: int,
                 max_positions: int, kv_tokens: int, graph: bool, results: dict, stats: dict) -> None:
    """Decode the requests `indices` (all of cache length `length`) in one slot batch, filling
    `results[i]` with each request's response and adding to `stats`."""
    rows = [Row(i, j) for i in indices for j in range(requests[i].num_samples)]
    slots = slot_count(len(rows), length, kv_tokens)
    dtype = next(model.parameters()).dtype
    if torch.is_autocast_enabled(next(model.parameters()).device.type):
        dtype = torch.get_autocast_dtype(next(model.parameters()).device.type)
    group = [requests[i] for i in indices]
    filters = (any(r.params.top_k != -1 for r in group), any(r.params.top_p < 1.0 for r in group))
    batch = SlotBatch(model, slots, length, max(r.params.max_tokens for r in group),
                      max(len(r.stop_token_ids) for r in group), filters, dtype, graph)
    waiting, free, running = list(rows), list(range(slots)), {}
    prefilled: dict[int, Prefilled] = {}
    sequences = {i: [None] * requests[i].num_samples for i in indices}
    steps = 0
    while waiting or running:
        # 1) admit waiting rows into free slots (prefilling their requests, together, once)
        admitted = waiting[:len(free)]
        wanted = sorted({row.request for row in admitted} - set(prefilled))
        stats["prefill_tokens"] += prefill_waiting(model, requests, wanted, max_positions, prefilled)
        for row in admitted:
            waiting.remove(row)
            row.slot = free.pop(0)
            batch.place(row, prefilled[row.request])
            running[row.slot] = row
        # 2) decode until the next look: SYNC_STEPS (SYNC_STEPS_WAITING while rows wait for a slot),
        #    or the first row reaching its max_tokens
        generated = batch.generated.tolist()
        left = min(requests[r.request].params.max_tokens - generated[s] for s, r in running.items())
        for _ in range(min(SYNC_STEPS_WAITING if waiting else SYNC_STEPS, left)):
            batch.step()
            steps += 1
        # 3) collect finished rows (stop tokens and max_tokens on the device, stop strings here)
        live, generated, stopped = batch.live.tolist(), batch.generated.tolist(), batch.stopped.tolist()
        finished = []
        for slot, row in running.items():
            request = requests[row.request]
            length, reason = generated[slot], "stop" if stopped[slot] else "length"
            if request.stop_strings:
                tokens = batch.out_tokens[slot, :length].tolist()
                at = stop_string_at(request, tokens, row.checked)
                row.checked = length
                if at is not None:
                    length, reason, live[slot] = at, "stop", False
            if not live[slot]:
                finished.append(slot)
                sequences[row.request][row.sample] = types.SampledSequence(
                    tokens=batch.out_tokens[slot, :length].tolist(),
                    logprobs=batch.out_logprobs[slot, :length].tolist(), stop_reason=reason)
        for slot in finished:
            batch.live[slot] = False
            del running[slot]
            free.append(slot)
        free.sort()
    for i in indices:
        results[i] = types.SampleResponse(sequences=sequences[i], prompt_logprobs=prefilled[i].prompt_logprobs)
    stats["steps"] += steps
    stats["row_steps"] += int(batch.row_steps)
    stats["slots"].append(slots)


def sample_many(model: torch.nn.Module, requests: Sequence[SampleRequest], *, max_positions: int,
                kv_tokens: int = DEFAULT_KV_TOKENS, graph: bool | None = None
                ) -> tuple[list[types.SampleResponse], DecodeStats]:
    """Every request's response, decoded together (requests already checked by the caller),
    and what the call did. Requests of one cache length share a slot batch; the groups run one
    after the other, in order of cache length. `graph`: each slot batch's step a captured CUDA
    graph (None: on CUDA)."""
    if graph is None:
        graph = next(model.parameters()).device.type == "cuda"
    groups: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        groups.setdefault(cache_len(request.positions, max_positions), []).append(i)
    results: dict[int, types.SampleResponse] = {}
    stats = {"steps": 0, "row_steps": 0, "prefill_tokens": 0, "slots": []}
    with torch.no_grad(), eager_attention(model):
        for length in sorted(groups):
            sample_group(model, requests, groups[length], length, max_positions, kv_tokens, graph, results, stats)
    responses = [results[i] for i in range(len(requests))]
    tokens = tuple(sum(len(s.tokens) for s in r.sequences) for r in responses)
    return responses, DecodeStats(stats["steps"], stats["row_steps"], stats["prefill_tokens"],
                                  tuple(stats["slots"]), tokens)
