"""`make bench-dashboard`: how fast the dashboard answers for a run of 10,000 rollouts.

A synthetic run directory (`synthetic_run`): a real SQLite store filled through the store's own
`import_detail`, `steps` steps of `groups` groups of `group_size` rollouts, each with `calls` model calls
whose prompts extend the previous call's tokens (so they merge into rows, one break per rollout in ten),
rewards in {0, 0.5, 1} (some groups all equal: zero variance), a few failed rollouts, held-out
evaluations every 10 steps, and a `metrics.jsonl` line per step. The dashboard is served by uvicorn
in this process; each API request is timed over loopback, and, when Debian's chromium and
chromium-driver are installed, so is each page in headless Chromium: from the start of the navigation
to the moment the page has fetched and drawn its view (`data-ready-ms`, on the page's own clock). The
first request or load after the server starts fills the dashboard's caches and is reported apart from
the median and max of the `--repeat` that follow. The baseline, in the same run: `harnessrl inspect`'s
whole index of the run (rows and breaks of every rollout), what a page that loaded every rollout at
once would wait for.

    python bench/dashboard.py --rollouts 10000 --out bench/results/dashboard.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from harnessrl.dashboard import RunData, create_dashboard
from harnessrl.inspection import index_report
from harnessrl.schema import (
    Attempt,
    AttemptStatus,
    Call,
    CallStatus,
    Reward,
    Rollout,
    RolloutDetail,
    RolloutState,
)
from harnessrl.services import free_port
from harnessrl.store import SQLiteStore


def _calls(rng: random.Random, rid: str, t: float, n: int, prompt_len: int, broken: bool) -> list[Call]:
    tokens = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
    out = []
    for i in range(n):
        completion = [rng.randrange(1000, 40000) for _ in range(rng.randrange(8, 40))] + [2]
        if broken and i == n - 1:
            tokens = [*tokens[:10], 7, *tokens[11:]]  # an edited history: a break
        msgs = [{"role": "user", "content": f"task {rid}"}] + [
            {"role": "tool", "tool_call_id": f"c{k}", "content": str(k)} for k in range(i)
        ]
        answer = {"role": "assistant", "content": "" if i < n - 1 else "done",
                  "tool_calls": [{"id": f"c{i}", "type": "function",
                                  "function": {"name": "calc", "arguments": json.dumps({"x": i})}}] if i < n - 1 else None}  # fmt: skip
        out.append(Call(
            call_id=f"{rid}-call{i}", rollout_id=rid, attempt=0, index=i, created_at=t + i, latency_s=0.4,
            status=CallStatus.OK, model="m", upstream="u", request={"model": "m", "temperature": 1.0},
            prompt_ids=list(tokens), completion_ids=completion,
            completion_logprobs=[round(-rng.random() * 3, 4) for _ in completion], weight_version=0,
            finish_reason="stop", chat={"messages": msgs, "tools": None, "answer": answer},
        ))  # fmt: skip
        tokens = tokens + completion + [rng.randrange(1000, 40000) for _ in range(12)]
    return out


def synthetic_run(run_dir: Path, steps: int, groups: int, group_size: int, calls: int = 3,
                  prompt_len: int = 300, seed: int = 0) -> int:  # fmt: skip
    """Write a synthetic run into `run_dir` (see the module docstring); returns the rollouts written."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"name": "synthetic", "train": {"steps": steps}}))
    (run_dir / "run.json").write_text(json.dumps({"run_id": "runsynth"}))
    store = SQLiteStore(run_dir / "store.sqlite")
    n, t, metrics = 0, 1.7e9, []
    try:
        for s in range(steps):
            rewards_step = []
            phases = [("train", g) for g in range(groups)]
            if s % 10 == 0:
                phases += [("eval", g) for g in range(groups)]
            for phase, g in phases:
                flat = rng.random() < 0.3
                for k in range(group_size if phase == "train" else 1):
                    rid = f"ro{n:07d}"
                    failed = rng.random() < 0.02
                    reward = None if failed else (0.5 if flat else rng.choice([0.0, 0.5, 1.0]))
                    meta = {"step": s} if phase == "train" else {"eval": f"eval-step{s}-t0"}
                    cid = f"runsynth-s{s}-t{g}-{k}" if phase == "train" else f"runsynth-eval-step{s}-t0-t{g}"
                    rollout = Rollout(
                        rollout_id=rid, client_id=cid, task_id=f"task-{g}",
                        group_id=f"runsynth-s{s}-t{g}" if phase == "train" else None,
                        state=RolloutState.FAILED if failed else RolloutState.SUCCEEDED, input={"q": g},
                        metadata=meta, created_at=t, updated_at=t + calls + 1, n_attempts=1,
                    )  # fmt: skip
                    detail = RolloutDetail(
                        rollout=rollout,
                        attempts=[Attempt(rollout_id=rid, attempt=0, status=AttemptStatus.EXITED,
                                          started_at=t, ended_at=t + calls, exit_code=1 if failed else 0)],
                        calls=_calls(rng, rid, t, calls, prompt_len, broken=n % 10 == 0),
                        reward=None if reward is None else Reward(rollout_id=rid, value=reward, updated_at=t + calls),
                    )  # fmt: skip
                    store.import_detail(detail)
                    if phase == "train" and reward is not None:
                        rewards_step.append(reward)
                    n, t = n + 1, t + 1
            metrics.append({
                "step": s + 1, "reward": sum(rewards_step) / max(len(rewards_step), 1),
                "rollouts": groups * group_size, "rows": groups * group_size, "tokens": 500 * groups * group_size,
                "trainable_tokens": 80 * groups * group_size, "merge_rate": 0.9, "loss": 0.01 * rng.random(),
                "kl": 0.001 * s, "entropy": 1.0 - 0.001 * s, "time_rollout_s": 30.0, "time_update_s": 12.0,
                "time_weight_sync_s": 1.0,
            })  # fmt: skip
    finally:
        store.close()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return n


class Server:
    """uvicorn serving the dashboard of `run_dir` in a thread on a free loopback port."""

    def __init__(self, run_dir: Path) -> None:
        self.data = RunData(run_dir / "store.sqlite", run_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(create_dashboard(self.data), host="127.0.0.1", port=self.port, log_level="warning",
                             timeout_graceful_shutdown=1)  # fmt: skip
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def time_api(url: str, paths: list[str], repeat: int) -> dict[str, dict[str, float]]:
    """Seconds of GET `url + path`: the first request (it fills the caches), then median and max."""
    out = {}
    with httpx.Client(base_url=url, timeout=60) as c:
        for p in paths:
            times = []
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                r = c.get(p)
                times.append(time.perf_counter() - t0)
                r.raise_for_status()
            out[p] = {"first_s": times[0], "median_s": statistics.median(times[1:]), "max_s": max(times[1:]),
                      "bytes": len(r.content)}  # fmt: skip
    return out


def time_pages(url: str, hashes: list[str], repeat: int) -> dict[str, dict[str, float]] | str:
    """Seconds from the start of navigation to the drawn view (the page's own `data-ready-ms` mark) per
    page in headless Chromium: the first load, then median and max; or why not measured."""
    import shutil

    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return "not measured: chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    opts = Options()
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    out = {}
    try:
        for h in hashes:
            times = []
            for _ in range(repeat + 1):
                driver.get("about:blank")
                driver.get(f"{url}/{h}")
                mark = WebDriverWait(driver, 30, poll_frequency=0.02).until(
                    lambda d: d.find_element("tag name", "body").get_attribute("data-ready-ms")
                )
                times.append(float(mark) / 1e3)
            out[h] = {"first_s": times[0], "median_s": statistics.median(times[1:]), "max_s": max(times[1:])}
    finally:
        driver.quit()
    return out


def main() -> int:
    """Build the synthetic run, time the API and the pages, print a table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=10_000, help="training rollouts (steps x 25 groups x 4)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    groups, size = 25, 4
    steps = max(1, args.rollouts // (groups * size))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        n = synthetic_run(run_dir, steps, groups, size)
        built = time.perf_counter() - t0
        mid = steps // 2
        with Server(run_dir) as srv:
            api = time_api(srv.url, [
                "/api/run", "/api/steps", "/api/rollouts?limit=50", f"/api/rollouts?step={mid}&limit=50",
                "/api/rollouts?zero_variance=1&reward_min=0.5&limit=50", "/api/rollouts?offset=9000&limit=50",
                "/api/rollouts?state=failed&limit=50", f"/api/groups?step={mid}", "/api/rollouts/ro0005000",
            ], args.repeat)  # fmt: skip
            t0 = time.perf_counter()
            everything = index_report(run_dir, limit=None)  # the baseline: every rollout summarised at once
            baseline = {"index_all_s": time.perf_counter() - t0, "rollouts": everything["total"]}
            pages = time_pages(srv.url, ["#/", f"#/rollouts?step={mid}", "#/rollout/ro0005000"], args.repeat)
    result = {"baseline": baseline, "rollouts_total": n, "steps": steps, "build_s": built, "api": api, "pages": pages,
              "python": sys.version.split()[0], "loadavg_1m_end": os.getloadavg()[0], "cpus": os.cpu_count()}  # fmt: skip
    print(
        f"synthetic run: {n} rollouts ({steps} steps x {groups} groups x {size} + evaluations), built in {built:.1f}s"
    )
    ms = lambda v: f"{v['first_s'] * 1e3:>10.1f}{v['median_s'] * 1e3:>10.1f}{v['max_s'] * 1e3:>10.1f}"  # noqa: E731
    print(f"{'request':<58}{'first ms':>10}{'median ms':>10}{'max ms':>10}{'kB':>8}")
    for k, v in api.items():
        print(f"{k:<58}{ms(v)}{v['bytes'] / 1e3:>8.1f}")
    print(
        f"baseline: harnessrl inspect's whole index ({baseline['rollouts']} training rollouts, rows and breaks "
        f"of each), what a page that loaded every rollout would wait for: {baseline['index_all_s'] * 1e3:.0f} ms"
    )
    if isinstance(pages, str):
        print(f"pages: {pages}")
    else:
        print(
            f"{'page (headless Chromium, navigation to drawn)':<58}{'first ms':>10}{'median ms':>10}{'max ms':>10}"
        )
        for k, v in pages.items():
            print(f"{k:<58}{ms(v)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
