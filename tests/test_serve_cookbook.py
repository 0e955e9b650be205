"""The unmodified tinker-cookbook 0.6.1 `math_rl` recipe (env=arithmetic, renderer role_colon,
loss importance_sampling, LoRA rank 8, a tiny local model, three steps) against `plexrl serve`
started by its command (`plexrl serve --engine process`, two devices, two tenants).

Run twice with the same seeds it logs identical per-step metrics (timings aside), alone or next
to another tenant running the same recipe at the same time; it resumes from its checkpoint after
the server restarts. (On a random tiny model every reward is the format penalty, so advantages
are zero and the weights do not move: these runs check the protocol, sampling determinism and
the sampler/trainer agreement `optim/kl_sample_train_v1`, not learning.) One server for the
module: the restart test restarts it on its state directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook")

ALICE = "tml-alice-cookbook-0123456789"
BOB = "tml-bob-cookbook-0123456789ab"
RECIPE_S = 300  # a recipe run's bound


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}


class Serving:
    """`plexrl serve` in a subprocess on a free loopback port; `restart` stops it and starts another
    on the same state directory."""

    def __init__(self, root: Path, model: str):
        keys = root / "keys.txt"
        keys.write_text(f"alice {ALICE}\nbob {BOB}\n")
        self.root = root
        self.command = [sys.executable, "-m", "plexrl.cli", "serve", "--engine", "process", "--devices", "2",
                        "--model", model, "--state-dir", str(root / "state"), "--port", "0", "--api-keys", str(keys)]
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=_env(), cwd=self.root)
        self.lines: list[str] = []
        found = threading.Event()

        def read(process, lines):
            for line in process.stdout:
                lines.append(line)
                if re.search(r"http://127\.0\.0\.1:\d+", line):
                    found.set()

        threading.Thread(target=read, args=(self.process, self.lines), daemon=True).start()
        if not found.wait(180):
            self.stop()
            raise AssertionError("plexrl serve did not start:\n" + "".join(self.lines))
        self.url = re.search(r"http://127\.0\.0\.1:\d+", "".join(self.lines)).group(0)

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from plexrl.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("cookbook") / "models" / "a" / "tiny", seed=0))


@pytest.fixture(scope="module")
def server(tmp_path_factory, model):
    """One server for the module (its start-up costs as much as a recipe run). Every test finds it
    running; the restart test leaves the server it restarted in its place."""
    serving = Serving(tmp_path_factory.mktemp("serve"), model)
    yield serving
    serving.stop()


def recipe(url: str, key: str, model: str, log_path: Path, max_steps: int = 3, resume: bool = False):
    command = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={model}",
               "renderer_name=role_colon", "env=arithmetic", "loss_fn=importance_sampling", f"base_url={url}",
               "group_size=2", "groups_per_batch=2", "max_tokens=12", f"max_steps={max_steps}", "lora_rank=8",
               "learning_rate=1e-3", "save_every=2", "eval_every=0", f"log_path={log_path}",
               f"behavior_if_log_dir_exists={'resume' if resume else 'delete'}"]
    done = subprocess.run(command, env={**_env(), "TINKER_API_KEY": key}, capture_output=True, text=True,
                          timeout=RECIPE_S, cwd=log_path.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return metrics(log_path)


def metrics(log_path: Path) -> list[dict]:
    """The per-step rows of metrics.jsonl without timings (which no two runs share)."""
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def test_math_rl_is_repeatable_alone_and_next_to_another_tenant(server, model, tmp_path):
    first = recipe(server.url, ALICE, model, tmp_path / "first")
    steps = [row for row in first if "optim/kl_sample_train_v1" in row]
    assert [row["step"] for row in steps] == [0, 1, 2]
    for row in steps:
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-4  # the sampler's log-probs are the trainer's
        assert row["env/all/total_episodes"] == 4 and "grad_norm:mean" in row
    assert recipe(server.url, ALICE, model, tmp_path / "again") == first

    together: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(key: str) -> None:
        try:
            together[key] = recipe(server.url, key, model, tmp_path / f"together-{key[4:9]}")
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(key,)) for key in (ALICE, BOB)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * RECIPE_S)
    assert not errors, errors
    assert together[ALICE] == first and together[BOB] == first


def test_math_rl_resumes_after_a_server_restart(server, model, tmp_path):
    log_path = tmp_path / "run"
    recipe(server.url, ALICE, model, log_path, max_steps=2)
    server.restart()
    saved = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["name"] == "final" and saved[-1]["batch"] == 2
    resumed = recipe(server.url, ALICE, model, log_path, max_steps=3, resume=True)
    assert [row["step"] for row in resumed if "optim/kl_sample_train_v1" in row] == [0, 1, 2]
    assert "Resumed training from tinker://" in (log_path / "logs.log").read_text()
