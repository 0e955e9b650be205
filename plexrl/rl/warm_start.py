"""Warm start: a tiny model taught the task's format by a short SFT phase, cached on disk.

RL from a random model never sees a reward, so each job starts from a tiny char-level Llama
trained on demonstrations of its task (through the same client API, on a private 1-device
cluster). The result is a `save_state` folder, loadable as any job's `base_model`, stored under
`cache_root()/<task>-<key>` where the key hashes every input that shapes the weights: task,
model config, steps, SFT settings, and the source of the code that builds it. Same inputs -> the
folder is reused; any change -> a new folder. A folder appears atomically (built aside, then
renamed), so a crash never leaves a half-written cache entry that looks valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from plexrl.models.tiny import make_tiny_model
from plexrl.rl.codec import Codec
from plexrl.rl.job import train_on
from plexrl.rl.rollout import sft_datum
from plexrl.rl.spec import ModelSpec
from plexrl.tasks import demonstration_text, make_task

CACHE_ENV = "PLEXRL_CACHE"
SFT_BATCH = 128  # small batches (32) stall on addition's carries for thousands of steps
SFT_LEARNING_RATE = 3e-3
# Enough SFT that RL sees rewards, little enough that rewards can still rise (2 cores, uncontended:
# about 10 s each). Measured greedy accuracy: addition ~0.4, countdown ~0.5 (with format credit).
DEFAULT_STEPS = {"addition": 350, "countdown": 200, "tool_use": 100}
_SOURCES = ("rl/warm_start.py", "rl/rollout.py", "rl/codec.py", "rl/job.py", "tasks/base.py",
            "tasks/addition.py", "tasks/countdown.py", "tasks/tool_use.py", "tasks/arith.py",
            "models/tiny.py", "backends/execution.py", "backends/losses.py", "runtime/checkpoint.py")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, "~/.cache/plexrl")).expanduser() / "warm"


def cache_key(task: str, model: ModelSpec, steps: int) -> str:
    package = Path(__file__).resolve().parent.parent
    code = hashlib.sha256(b"".join((package / name).read_bytes() for name in _SOURCES)).hexdigest()
    inputs = {"task": task, "model": model.model_dump(), "steps": steps, "batch": SFT_BATCH,
              "learning_rate": SFT_LEARNING_RATE, "code": code}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def warm_model(task: str, model: ModelSpec, steps: int | None = None, root: Path | None = None) -> Path:
    """The warmed model folder for (task, model, steps): from the cache, or built and cached."""
    steps = steps if steps is not None else model.warm_start_steps
    steps = DEFAULT_STEPS[task] if steps is None else steps
    root = cache_root() if root is None else Path(root)
    folder = root / f"{task}-{cache_key(task, model, steps)}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".building-", dir=root) as aside:
        built = build(task, model, steps, Path(aside))
        try:
            os.rename(built, folder)
        except OSError:  # another process cached the same inputs first: theirs is as good
            if not (folder / "config.json").is_file():
                raise
    return folder


def build(task_name: str, model: ModelSpec, steps: int, workdir: Path) -> Path:
    """Make the random model, train it `steps` SFT steps, return its save_state copy in `workdir`."""
    from plexrl.engines.local import LocalCluster  # the runtime is only needed to build

    initial = make_tiny_model(workdir / "initial", seed=model.seed, hidden_size=model.hidden_size,
                              num_layers=model.num_layers, num_heads=model.num_heads)
    task, codec = make_task(task_name), Codec.from_model(initial)
    with LocalCluster(devices=1, workdir=workdir / "cluster") as cluster:
        trainer = cluster.service_client("warm-start").create_training_client(base_model=initial, seed=model.seed)
        for step in range(steps):
            train_on(trainer, sft_batch(task, codec, np.random.default_rng([model.seed, step])),
                     SFT_LEARNING_RATE, "cross_entropy")
        saved = Path(trainer.save_state("warm").result().path)
        shutil.copytree(saved, workdir / "warm")
    return workdir / "warm"


def sft_batch(task, codec: Codec, rng: np.random.Generator) -> list:
    """SFT_BATCH demonstrations, weighted so the summed loss is a mean over completion tokens."""
    pairs = [demonstration_text(task, task.sample_problem(rng)) for _ in range(SFT_BATCH)]
    weight = 1.0 / sum(len(codec.encode(completion)) for _, completion in pairs)
    return [sft_datum(codec, prompt, completion, weight) for prompt, completion in pairs]
