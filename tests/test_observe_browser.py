"""The dashboard as an operator uses it: `plexrl serve` with two tenants training, `/dashboard` in
a real headless Chromium (Debian's chromium and chromium-driver, through Selenium). The page asks
for the operator key, shows both jobs in the device lanes while they train, and its jobs table and
device figures are `cluster.metrics()` once the tenants are done. A screenshot is saved while they train: to
$PLEXRL_DASHBOARD_SCREENSHOT when set (the README's: `make screenshot`), else into the test's folder.
Skipped, saying why, only where no browser is installed (`make install` installs one where apt can).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from tinker import types  # noqa: E402

from plexrl.engines.local import LocalCluster  # noqa: E402
from plexrl.models.tiny import parameter_count  # noqa: E402
from plexrl.serve.app import create_app  # noqa: E402
from plexrl.serve.limits import Limits  # noqa: E402
from plexrl.serve.server import Server  # noqa: E402
from plexrl.serve.service import TinkerService  # noqa: E402
from plexrl.serve.store import Store  # noqa: E402
from tests.helpers import reserve_bytes  # noqa: E402
from tests.test_observe_metrics import ALICE, BOB, OPERATOR, key_file  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
T = 120
STEPS = 30  # per tenant: seconds of work, the lanes show both jobs at it
REWARD_S = 0.05  # the controller's own time a step (rewards): the idle gaps of its track


def browser_paths() -> tuple[str, str]:
    chromium = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("no headless Chromium here (chromium and chromedriver not on PATH): `make install` installs "
                    "Debian's chromium and chromium-driver where apt-get runs as root")
    return chromium, driver


@pytest.fixture
def chrome():
    chromium, driver = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,480",
                 "--disable-gpu", "--no-first-run"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver), options=options)
    browser.set_page_load_timeout(60)
    try:
        yield browser
    finally:
        browser.quit()


def tenant_trains(url: str, key: str, model: str, steps: int, failures: list) -> None:
    """A tenant's job: two models trained in turn (a policy and a critic, say), a pause for rewards."""
    try:
        client = tinker.ServiceClient(base_url=url, api_key=key)
        try:
            models = [client.create_lora_training_client(model, rank=0, seed=seed).result(T) for seed in (1, 2)]
            ids = models[0].get_tokenizer().encode("12+34=46 and 5+6=11")
            datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
            for _ in range(steps):
                for training in models:
                    training.forward_backward([datum], "cross_entropy").result(T)
                    training.optim_step(types.AdamParams(learning_rate=1e-3)).result(T)
                time.sleep(REWARD_S)
        finally:
            client.close("success").result(T)
    except Exception as exc:  # the main thread reports it
        failures.append(exc)


# What the page shows, read in one script run: the page redraws between two polls, never during one.
READ_PAGE = """
const q = (sel) => [...document.querySelectorAll(sel)];
return {
  polls: Number(document.body.dataset.polls || 0),
  status: document.getElementById("status").dataset.state,
  lanes: q("#lanes rect.call").map((r) => r.dataset.job),
  switches: q("#lanes rect.switch").length,
  busy: Object.fromEntries(q("#lanes .lane").map((l) => [l.dataset.device, l.querySelector(".busy").textContent])),
  queues: q("#queues .queue").map((r) => r.dataset.node),
  rows: Object.fromEntries(q("#jobs tbody tr").map((r) => [r.dataset.job,
    Object.fromEntries([...r.cells].map((c) => [c.dataset.field, c.textContent]))])),
};
"""


def page(browser) -> dict:
    return browser.execute_script(READ_PAGE)


def lane_jobs(browser) -> set[str]:
    return set(page(browser)["lanes"])


def test_dashboard_in_a_real_browser(tmp_path, tiny_model, chrome):
    # each device has room for one trainer: four of them (two per tenant) on two devices keep switching
    trainer_bytes = 16 * parameter_count(tiny_model)  # weights, gradients, two Adam moments: fp32
    cluster = LocalCluster(devices=2, checkpoint_dir=str(tmp_path / "scratch"),
                           device_memory_bytes=trainer_bytes + trainer_bytes // 4 + reserve_bytes(tiny_model))
    tenants = key_file(tmp_path, f"alice {ALICE}", f"bob {BOB}", f"@operator {OPERATOR}")
    service = TinkerService(cluster, Store(tmp_path / "state"), {tiny_model: tiny_model}, tenants, Limits(poll_hold_s=1.0))
    failures: list = []
    try:
        with Server(create_app(service)) as server:
            chrome.get(f"{server.url}/dashboard?window=60&interval=500")
            wait = WebDriverWait(chrome, T, poll_frequency=0.2)
            # 1) no key yet: the page asks for one, and shows nothing of anyone's
            form = wait.until(lambda b: b.find_element(By.ID, "login") if b.find_element(By.ID, "login").is_displayed()
                              else None)
            assert "operator" in chrome.find_element(By.ID, "login-error").text
            chrome.find_element(By.ID, "key").send_keys(OPERATOR)
            form.submit()
            wait.until(lambda b: page(b)["status"] == "live")
            # 2) two tenants train; the lanes show both jobs
            threads = [threading.Thread(target=tenant_trains, args=(server.url, key, tiny_model, STEPS, failures))
                       for key in (ALICE, BOB)]
            for t in threads:
                t.start()
            wait.until(lambda b: len(service.sessions) == 2)
            jobs = {s.job for s in service.sessions.values()}
            wait.until(lambda b: lane_jobs(b) >= jobs and page(b)["switches"] > 0)
            polls = page(chrome)["polls"]
            wait.until(lambda b: page(b)["polls"] > polls + 4 or not any(t.is_alive() for t in threads))
            shot = Path(os.environ.get("PLEXRL_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
            shot.parent.mkdir(parents=True, exist_ok=True)
            assert chrome.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
            for t in threads:
                t.join(timeout=300)
            assert not failures and not any(t.is_alive() for t in threads), failures
            # 3) quiet now: the next poll's table and devices are the cluster's metrics()
            metrics = cluster.metrics()
            polls = page(chrome)["polls"]
            wait.until(lambda b: page(b)["polls"] > polls + 1)
            shown = page(chrome)
            assert set(shown["rows"]) == set(metrics["jobs"]) == jobs
            tenant_of = {s.job: s.tenant for s in service.sessions.values()}
            for job, row in shown["rows"].items():
                usage = metrics["jobs"][job]
                assert row["consumed_device_s"] == f"{usage['consumed_device_s']:.3f}"
                assert row["queue_wait_s"] == f"{usage['queue_wait_s']:.3f}"
                assert row["requests"] == str(usage["requests"])
                assert row["tenant"] == tenant_of[job]
                states = [sum(1 for sid, where in metrics["residency"].items()
                              if sid.split("/")[0] == job and where.split(":")[0] == tier)
                          for tier in ("device", "host", "disk")]
                assert row["states"] == " / ".join(map(str, states))
                assert row["slack"] == f"{100 * metrics['placement'][job]['slack']:.0f}%"
            busy = metrics["device_busy_s_per_device"]
            assert shown["busy"] == {str(d): f"{busy.get(d, 0.0):.1f} busy-s" for d in range(metrics["devices"])}
            assert shown["queues"] == ["0"]
            assert set(shown["lanes"]) == jobs  # the last minute's lanes: both jobs, no one else's
    finally:
        service.close()
        cluster.close()
