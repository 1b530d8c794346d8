"""The dashboard in a real browser: headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium) loads each page of a real recorded run (the calc demo, tests/fixtures/dashboard, read back with
`harnessrl import`), checks what it shows against the API and the run's files, uses the filters, the
pager and the token colouring, sees a live update, and saves screenshots.

Screenshots go to a temporary folder; with HARNESSRL_SCREENSHOTS=DIR (`make screenshots`: docs/img) they
are written there for the docs. Skipped, saying why, where Chromium or its driver is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl.dashboard import RunData, create_dashboard
from harnessrl.export.traces import import_trace
from tests.support.gateway import ThreadServer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dashboard" / "calc-demo.trace.jsonl.gz"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium"

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # pragma: no cover - selenium is in the dev extra
    webdriver = None  # type: ignore[assignment]

pytestmark = pytest.mark.skipif(
    webdriver is None or CHROMIUM is None or DRIVER is None,
    reason=f"headless Chromium is not installed here (needs chromium, chromedriver and selenium: {INSTALL})",
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The recorded calc demo, imported into a fresh run directory; tokens decoded with SmolLM2's
    tokenizer (the tiny model's, the same file)."""
    run = tmp_path_factory.mktemp("browser") / "run"
    assert import_trace(FIXTURE, run) == 53
    cfg = json.loads((run / "config.json").read_text())
    cfg["engine"]["model"] = str(tiny_model_dir)
    (run / "config.json").write_text(json.dumps(cfg))
    return run


@pytest.fixture(scope="module")
def server(run_dir: Path) -> Iterator[ThreadServer]:
    with ThreadServer(create_dashboard(RunData(run_dir / "store.sqlite", run_dir))) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(server: ThreadServer) -> Iterator[WebDriver]:
    """Headless Chromium (closed before the server, so no live stream holds the server open)."""
    opts = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--hide-scrollbars"):  # fmt: skip
        opts.add_argument(arg)
    if CHROMIUM:
        opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = os.environ.get("HARNESSRL_SCREENSHOTS")
    path = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _ready(driver: WebDriver) -> str:
    return driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready") or ""


def _open(driver: WebDriver, url: str) -> None:
    """Load the page afresh at `url` and wait until its view is drawn."""
    driver.get("about:blank")
    driver.get(url)
    WebDriverWait(driver, 20).until(lambda d: _ready(d) != "")


def _after(driver: WebDriver, action: Any) -> None:
    """Do something that re-renders the view (a filter, the pager) and wait for the new view."""
    before = _ready(driver)
    action()
    WebDriverWait(driver, 20).until(lambda d: _ready(d) != before)


def _shot(driver: WebDriver, folder: Path, name: str, height: int | None = None) -> None:
    full = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(height or full, 2600))
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(folder / f"dashboard-{name}.png"))
    driver.set_window_size(1400, 1000)


def _rows(driver: WebDriver, table: str) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")


def _severe(driver: WebDriver) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_run_page_plots_and_steps(
    browser: WebDriver, server: ThreadServer, run_dir: Path, shots: Path
) -> None:
    _open(browser, f"{server.url}/#/")
    assert browser.find_element(By.CSS_SELECTOR, "#view-run h1").text.startswith("run calc")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chart-reward circle")) == len(metrics) == 3
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chart-heldout circle")) == 2  # before, after
    for chart in ("loss", "kl", "entropy", "length", "merge"):
        assert browser.find_elements(By.CSS_SELECTOR, f"#chart-{chart} svg"), chart
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-time rect")
    rows = _rows(browser, "steps-table")
    assert len(rows) == 3
    cells = rows[1].find_elements(By.TAG_NAME, "td")
    assert cells[0].text == "step 2" and cells[1].text == f"{metrics[1]['reward']:.3f}"
    assert "retokenized 2" in cells[10].text  # the step's merge breaks, as metrics.jsonl counted them
    last = rows[2].find_elements(By.TAG_NAME, "td")
    assert last[2].text == "0.875"  # held-out after step 3, from the evaluation's rollouts
    assert "0.750 before → 0.875 after" in browser.find_element(By.ID, "view-run").text
    assert "53 (" in browser.find_element(By.ID, "rollout-counts").text
    assert not _severe(browser)
    _shot(browser, shots, "run", height=1400)


def test_step_page_groups_filters_and_pager(browser: WebDriver, server: ThreadServer, shots: Path) -> None:
    _open(browser, f"{server.url}/#/")
    _after(browser, lambda: browser.find_element(By.LINK_TEXT, "step 2").click())
    assert browser.find_element(By.CSS_SELECTOR, "#view-rollouts h1").text == "step 2"
    api = httpx.get(f"{server.url}/api/rollouts?step=2&limit=50").json()
    assert (
        len(_rows(browser, "groups-table")) == 3
        and len(_rows(browser, "rollouts-table")) == 12 == api["total"]
    )
    shown = {r.get_attribute("data-rollout"): r.find_elements(By.TAG_NAME, "td")[5].text
             for r in _rows(browser, "rollouts-table")}  # fmt: skip
    assert shown == {i["rollout_id"]: f"{i['reward']:g}" for i in api["items"]}
    _shot(browser, shots, "step")

    zv = httpx.get(f"{server.url}/api/rollouts?step=2&zero_variance=1").json()["total"]
    _after(browser, lambda: Select(browser.find_element(By.NAME, "zero_variance")).select_by_value("1"))
    assert "zero_variance=1" in browser.current_url
    rows = _rows(browser, "rollouts-table")
    if zv:
        assert len(rows) == zv and all("zv" in r.text for r in rows)
    else:
        assert "no rollout matches" in rows[0].text
    _after(browser, lambda: Select(browser.find_element(By.NAME, "zero_variance")).select_by_value(""))

    box = browser.find_element(By.NAME, "reward_min")
    box.send_keys("1")
    _after(browser, lambda: browser.find_element(By.ID, "apply").click())
    rewards = [r.find_elements(By.TAG_NAME, "td")[5].text for r in _rows(browser, "rollouts-table")]
    assert rewards and set(rewards) == {"1"} and len(rewards) == sum(i["reward"] >= 1 for i in api["items"])

    _after(browser, lambda: Select(browser.find_element(By.NAME, "state")).select_by_value("failed"))
    assert "no rollout matches these filters" in browser.find_element(By.ID, "rollouts-table").text

    _open(browser, f"{server.url}/#/rollouts?phase=all")  # 53 rollouts: two pages of 50
    assert browser.find_element(By.CSS_SELECTOR, ".pager .range").text == "1–50 of 53"
    _after(browser, lambda: browser.find_element(By.CSS_SELECTOR, ".pager .next").click())
    assert browser.find_element(By.CSS_SELECTOR, ".pager .range").text == "51–53 of 53"
    assert len(_rows(browser, "rollouts-table")) == 3
    assert not _severe(browser)


def test_rollout_page_calls_tool_calls_and_coloured_rows(
    browser: WebDriver, server: ThreadServer, shots: Path
) -> None:
    items = httpx.get(f"{server.url}/api/rollouts?phase=all&limit=100").json()["items"]
    broken = next(i for i in items if i["breaks"])  # a rollout whose calls did not merge into one row
    rep = httpx.get(f"{server.url}/api/rollouts/{broken['rollout_id']}").json()
    _open(browser, f"{server.url}/#/rollout/{broken['rollout_id']}")
    view = browser.find_element(By.ID, "view-rollout")
    assert broken["rollout_id"] in view.find_element(By.TAG_NAME, "h1").text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#calls .call")) == len(rep["calls"])
    cause = next(c["break_cause"] for c in rep["calls"] if c["break_cause"])
    assert f"break: {cause}" in browser.find_element(By.ID, "calls").text
    n_tools = sum(len(c["tool_calls"]) for c in rep["calls"])
    assert len(browser.find_elements(By.CSS_SELECTOR, "#calls .answer .tool")) == n_tools
    if n_tools:
        first = next(t for c in rep["calls"] for t in c["tool_calls"])
        assert f"{first['name']}(" in browser.find_element(By.ID, "calls").text
    assert rep["calls"][0]["completion_text"].strip()[:20] in browser.find_element(By.ID, "calls").text
    row = rep["rows"][0]
    spans = browser.find_elements(By.CSS_SELECTOR, '#rows .tokens[data-row="0"] span')
    assert len(spans) == row["n_tokens"] == len(row["tokens"])
    trainable = browser.find_elements(By.CSS_SELECTOR, '#rows .tokens[data-row="0"] span.m1')
    assert len(trainable) == row["n_trainable"] == sum(row["loss_mask"])
    assert "".join(s.get_attribute("textContent") for s in spans) == "".join(row["pieces"])
    _shot(browser, shots, "rollout")

    browser.find_element(By.CSS_SELECTOR, '#modes input[value="logprob"]').click()
    lps = [lp for lp, m in zip(row["logprobs"], row["loss_mask"], strict=True) if m]
    trainable = browser.find_elements(By.CSS_SELECTOR, '#rows .tokens[data-row="0"] span.m1')
    want = ["rgba(187, 247, 208, 1)" if lp >= -0.5 else "rgba(254, 240, 138, 1)" if lp >= -2.3 else "rgba(254, 202, 202, 1)"
            for lp in lps]  # fmt: skip
    assert [s.value_of_css_property("background-color") for s in trainable[:40]] == want[:40]
    assert "logprob" in browser.find_element(By.ID, "legend").text
    browser.execute_script("document.getElementById('rows').scrollIntoView()")
    browser.save_screenshot(str(shots / "dashboard-rows-logprob.png"))
    assert not _severe(browser)


def test_live_update_while_the_run_goes_on(browser: WebDriver, server: ThreadServer, run_dir: Path) -> None:
    _open(browser, f"{server.url}/#/")
    WebDriverWait(browser, 10).until(lambda d: "on" in d.find_element(By.ID, "live").get_attribute("class"))
    metrics = run_dir / "metrics.jsonl"
    last = json.loads(metrics.read_text().splitlines()[-1])
    with metrics.open("a") as f:  # the trainer finishes step 4
        f.write(json.dumps({**last, "step": 4, "reward": 0.9}) + "\n")
    WebDriverWait(browser, 15).until(lambda d: len(_rows(d, "steps-table")) == 4)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chart-reward circle")) == 4
