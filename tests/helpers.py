"""Small builders shared by the test modules."""

from __future__ import annotations

import functools

import numpy as np

import plexrl


@functools.lru_cache(maxsize=None)
def reserve_bytes(model_dir: str, tokens: int | None = None) -> int:
    """The activation reserve a CPU cluster measures for `model_dir` (the runtime's own probe):
    what a test's device budget must hold beside the states it means to fit."""
    from plexrl.runtime.activation import reserve_of

    return reserve_of(model_dir, tokens)


def datum(ids, **extra) -> plexrl.Datum:
    """A next-token datum over `ids` (Tinker convention: targets are the inputs shifted by one)."""
    return plexrl.Datum(plexrl.ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:], **extra})


def rl_job(cluster, job: str, model_dir: str, seed: int, steps: int = 3, timeout: float = 120, name: str = "policy",
           sampler: str = "hf", rewards: list | None = None, declare_steps: bool = False,
           admission_timeout: float = 600):
    """A small policy-gradient loop over every function of the API: sample, old log-probs,
    importance-sampling update, weight sync (snapshots sampling with `sampler`), a step mark.
    Returns the job's training client; each step's rewards are appended to `rewards` if given.
    `declare_steps`: the job tells the cluster how many steps it runs (`service_client(steps=)`).
    Every wait is bounded: a call's result by `timeout`, the job's admission by `admission_timeout`
    (AdmissionTimeout; the library's default waits for as long as it takes)."""
    service = cluster.service_client(job=job, steps=steps if declare_steps else None,
                                     admission_timeout=admission_timeout)
    trainer = service.create_training_client(base_model=model_dir, seed=seed, name=name)
    prompt = [5 + seed, 6, 7]
    for step in range(steps):
        snapshot = trainer.save_weights_and_get_sampling_client(sampler=sampler)
        params = plexrl.SamplingParams(max_tokens=5, seed=100 * seed + step)
        out = snapshot.sample(plexrl.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result(timeout)
        step_rewards = np.array([float(sum(s.tokens) % 7) for s in out.sequences])
        if rewards is not None:
            rewards.append(step_rewards.tolist())
        data = []
        for seq, adv in zip(out.sequences, step_rewards - step_rewards.mean()):
            ids = prompt + seq.tokens
            old = snapshot.compute_logprobs(plexrl.ModelInput.from_ints(ids)).result(timeout)
            advantages = np.zeros(len(ids) - 1, dtype=np.float32)
            advantages[len(prompt) - 1:] = adv
            data.append(datum(ids, logprobs=np.array(old[1:], dtype=np.float32), advantages=advantages))
        trainer.forward_backward(data, loss_fn="importance_sampling").result(timeout)
        trainer.optim_step(plexrl.AdamParams(learning_rate=1e-2)).result(timeout)
        cluster.report_step(job, step)
    return trainer


def weights(cluster, client):
    """A model client's current weights (flat float32, a torch tensor), read from the cluster."""
    import torch

    return torch.from_numpy(cluster.fetch_weights(client.state))


def run_with_blocked_imports(blocked: tuple[str, ...], body: str, timeout: float = 300):
    """Run `body` (Python source) in a fresh interpreter where importing any of `blocked` (top-level
    package names) raises ImportError, then check none of them got loaded. The finished process."""
    import subprocess
    import sys

    script = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
{body}
loaded = sorted(n for n in sys.modules if n.split('.')[0] in {blocked!r})
assert not loaded, loaded
"""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
