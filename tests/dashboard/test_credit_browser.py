"""The dashboard's rollout page shows the judge's call, the step rewards and the annotations, in a real
headless Chromium over a run folder with a real SQLite store (skipped where Chromium is missing)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harnessrl.dashboard import RunData, create_dashboard
from harnessrl.schema import AnnotationIn, RewardIn, RolloutCreate, RolloutState, StepReward
from harnessrl.store import SQLiteStore
from tests.support.gateway import ThreadServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the dev extra)")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None, reason="headless Chromium is not installed here"
)

JUDGE = {"mode": "single", "model": "judge-m", "score": 7.0, "answer": "Nicely formal.\nSCORE: 7",
         "prompt": [{"role": "system", "content": "Rubric: very formal English"},
                    {"role": "user", "content": "Answer:\nKindly note the meeting is moved."}]}  # fmt: skip
LOGPROB_JUDGE = {"mode": "logprob", "model": "judge-m", "score": 6.25, "answer": "7", "digit_mass": 0.8,
                 "digits": {"3": 0.2, "7": 0.5, "9": 0.1}, "prompt": [{"role": "user", "content": "rate"}]}  # fmt: skip


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    store = SQLiteStore(tmp_path / "store.sqlite")
    store.create_rollout(RolloutCreate(client_id="c1", task_id="style", group_id="g"), "ro-judged")
    store.start_attempt("ro-judged")
    store.set_state("ro-judged", RolloutState.SUCCEEDED)
    store.set_reward(
        "ro-judged", RewardIn(value=0.7, details={"judge": JUDGE}, steps=[StepReward(call=0, value=0.25)])
    )
    store.add_annotation("ro-judged", AnnotationIn(call=0, value=1.0, label="polite"))
    store.create_rollout(RolloutCreate(client_id="c2", task_id="style"), "ro-logprob")
    store.start_attempt("ro-logprob")
    store.set_state("ro-logprob", RolloutState.SUCCEEDED)
    store.set_reward("ro-logprob", RewardIn(value=6.25 / 9, details={"judge": LOGPROB_JUDGE}))
    store.close()
    with ThreadServer(create_dashboard(RunData(tmp_path / "store.sqlite", tmp_path))) as srv:
        yield srv


def test_rollout_page_shows_the_judge_and_step_rewards(server: ThreadServer) -> None:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    assert httpx.get(f"{server.url}/api/rollouts/ro-judged").json()["credit"]["judge"]["score"] == 7.0
    opts = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    opts.binary_location = str(CHROMIUM)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        driver.get(f"{server.url}/#/rollout/ro-judged")
        WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.ID, "credit"))
        judge = driver.find_element(By.ID, "judge").text
        assert "judge (single, judge-m)" in judge and "score 7" in judge and "SCORE: 7" in judge
        steps = driver.find_element(By.ID, "steps").text
        assert "grader call 0 0.250" in steps and "annotation call 0 1 (data) polite" in steps
        driver.get(f"{server.url}/#/rollout/ro-logprob")  # a logprob judge: the digits behind its score
        WebDriverWait(driver, 30).until(
            lambda d: any("logprob" in e.text for e in d.find_elements(By.ID, "judge"))
        )
        judge = driver.find_element(By.ID, "judge").text
        assert "score 6.25" in judge and "digits hold 0.8 of the top 20: 3: 0.20, 7: 0.50, 9: 0.10" in judge
    finally:
        driver.quit()
