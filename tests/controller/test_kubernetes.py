"""The Kubernetes runner against a fake API server over real HTTP on loopback.

No API server can run here, so `tests/fixtures/kubernetes/fake_api.py` serves bodies transcribed from
the Kubernetes API (see that directory's README) and runs each Job's container command as a local
process, so the runner's wrapper script and the output round trip through the pod log are real.
`test_real_cluster_one_attempt` runs against a real cluster when KUBECONFIG is set.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import os
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl.controller.runner import AttemptSpec, HarnessSpec
from harnessrl.controller.runners.kubernetes import KubernetesRunner, KubernetesSpec, TokenBucket
from harnessrl.controller.runners.kubernetes_api import ClusterAccess
from harnessrl.controller.runners.kubernetes_jobs import (
    OUTPUT_MARKER,
    network_policy,
    split_log,
    unpack_output,
)
from harnessrl.controller.runners.kubernetes_tracker import JobTracker
from tests.fixtures.kubernetes.fake_api import HERE, FakeKube
from tests.support.gateway import ThreadServer

TEMPLATE = """
metadata:
  labels: {team: rl}
spec:
  containers:
  - name: harness
    image: python:3.12-slim
    resources: {limits: {cpu: "1", memory: 1Gi}}
"""

HARNESS = r"""
import json, os, sys, time
task = json.load(open(os.environ["HARNESSRL_TASK"]))
time.sleep(task.get("sleep", 0))
out = os.environ["HARNESSRL_OUTPUT"]
os.makedirs(os.path.join(out, "sub"), exist_ok=True)
json.dump({"answer": task["a"] + task["b"], "key": os.environ["OPENAI_API_KEY"],
           "base": os.environ["OPENAI_BASE_URL"]}, open(os.path.join(out, "answer.json"), "w"))
open(os.path.join(out, "sub", "notes.txt"), "w").write("n" * 100)
print("harness says hi")
print("to stderr", file=sys.stderr)
sys.exit(task.get("exit", 0))
"""
CLUSTER_GATEWAY = "http://gateway.harnessrl.svc:8000"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[FakeKube, str]]:
    """The fake API server, running on loopback."""
    kube = FakeKube(tmp_path / "kubelet")
    with ThreadServer(kube.app) as srv:
        yield kube, srv.url


def make_runner(url: str, rate: TokenBucket | None = None, **over: Any) -> KubernetesRunner:
    """A runner against the fake, with short intervals."""
    opts: dict[str, Any] = {"reconcile_interval_s": 1.0, "pod_check_interval_s": 0.1, "start_timeout_s": 0.5}
    opts.update(over)
    spec = KubernetesSpec(pod_template=TEMPLATE, run="run-1", gateway_url=CLUSTER_GATEWAY, **opts)
    return KubernetesRunner(spec, ClusterAccess(server=url, namespace="hrl", token="test-token"), rate)


def attempt(tmp_path: Path, rid: str = "ro0123abcd", n: int = 1, **task: Any) -> AttemptSpec:
    """An attempt whose task input drives the test harness."""
    return AttemptSpec(
        rid, n, "key-" + rid, "http://127.0.0.1:1", {"a": 2, "b": 3, **task}, tmp_path / rid / f"attempt-{n}"
    )


def harness(timeout_s: float = 30.0) -> HarnessSpec:
    """The test harness, run by the fake kubelet with this Python."""
    return HarnessSpec(command=[sys.executable, "-c", HARNESS], timeout_s=timeout_s)


async def test_success_recovers_output_files(fake: tuple[FakeKube, str], tmp_path: Path) -> None:
    kube, url = fake
    runner = make_runner(url)
    try:
        res = await runner.run(attempt(tmp_path), harness())
    finally:
        await runner.aclose()
    assert res.infra_error is None and res.exit_code == 0 and not res.timed_out
    answer = json.loads((res.output_dir / "answer.json").read_text())
    assert answer == {"answer": 5, "key": "key-ro0123abcd", "base": CLUSTER_GATEWAY + "/v1"}
    assert (res.output_dir / "sub" / "notes.txt").read_text() == "n" * 100
    assert "harness says hi" in res.stdout_tail and OUTPUT_MARKER not in res.stdout_tail
    (name,) = kube.created_jobs
    job = kube.jobs[name]
    assert job["spec"]["activeDeadlineSeconds"] == 30 and job["spec"]["backoffLimit"] == 0
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["team"] == "rl" and pod_labels["harnessrl.io/rollout"] == "ro0123abcd"
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "value" not in env["OPENAI_API_KEY"] and "PATH" not in env  # key via Secret, no host env
    assert kube.deleted_secrets == [name]  # the Secret is gone after the attempt


async def test_nonzero_exit_is_a_graded_result(fake: tuple[FakeKube, str], tmp_path: Path) -> None:
    _, url = fake
    runner = make_runner(url)
    try:
        res = await runner.run(attempt(tmp_path, exit=3), harness())
    finally:
        await runner.aclose()
    assert res.infra_error is None and res.exit_code == 3 and not res.timed_out
    assert json.loads((res.output_dir / "answer.json").read_text())["answer"] == 5


async def test_deadline_exceeded_is_timed_out(fake: tuple[FakeKube, str], tmp_path: Path) -> None:
    kube, url = fake
    runner = make_runner(url)
    try:
        res = await runner.run(attempt(tmp_path, sleep=30), harness(timeout_s=1))
    finally:
        await runner.aclose()
    assert res.timed_out and res.exit_code is None and res.infra_error is None
    assert kube.jobs[kube.created_jobs[0]]["status"]["conditions"][-1]["reason"] == "DeadlineExceeded"


@pytest.mark.parametrize(
    ("mode", "reason"), [("unschedulable", "Unschedulable"), ("image_pull", "ImagePullBackOff")]
)
async def test_pod_that_cannot_start_is_infra_error(
    fake: tuple[FakeKube, str], tmp_path: Path, mode: str, reason: str
) -> None:
    kube, url = fake
    kube.pod_mode = mode
    runner = make_runner(url)
    try:
        res = await runner.run(attempt(tmp_path), harness())
    finally:
        await runner.aclose()
    assert res.infra_error is not None and reason in res.infra_error
    assert [n for n, _ in kube.deleted_jobs] == kube.created_jobs  # the stuck Job is removed


async def test_api_errors_are_infra_errors(fake: tuple[FakeKube, str], tmp_path: Path) -> None:
    kube, url = fake
    kube.fail_job_create = 500
    runner = make_runner(url)
    try:
        res = await runner.run(attempt(tmp_path), harness())
        assert res.infra_error is not None and "InternalError" in res.infra_error
        kube.fail_job_create = None
        invalid = {"spec": {"containers": [{"name": "harness"}]}}  # no image: 422 Invalid
        bad = KubernetesRunner(KubernetesSpec(pod_template=invalid, run="run-1"), runner.api.access)
        res = await bad.run(attempt(tmp_path, rid="ro2"), harness())
        await bad.aclose()
        assert res.infra_error is not None and "Invalid" in res.infra_error and "image" in res.infra_error
    finally:
        await runner.aclose()


def test_fake_rejects_a_job_that_breaks_the_contract(fake: tuple[FakeKube, str]) -> None:
    kube, url = fake
    job = {
        "metadata": {"name": "j", "labels": {}},
        "spec": {
            "backoffLimit": 6,
            "template": {
                "spec": {"restartPolicy": "OnFailure", "containers": [{"name": "c", "image": "busybox"}]}
            },
        },
    }
    r = httpx.post(
        f"{url}/apis/batch/v1/namespaces/hrl/jobs", json=job, headers={"Authorization": "Bearer test-token"}
    )
    assert r.status_code == 422 and r.json()["reason"] == "Invalid"
    fields = {c["field"] for c in r.json()["details"]["causes"]}
    assert {"spec.backoffLimit", "spec.template.spec.restartPolicy", "metadata.labels"} <= fields
    assert not kube.jobs


@pytest.mark.parametrize("mode", ["silent", "drop"])
async def test_reconcile_finds_completion_when_watch_misses_it(
    fake: tuple[FakeKube, str], tmp_path: Path, mode: str
) -> None:
    kube, url = fake
    kube.watch_mode = mode
    runner = make_runner(url, reconcile_interval_s=0.5)
    try:
        res = await runner.run(attempt(tmp_path), harness())
        relists = runner.tracker.relists
    finally:
        await runner.aclose()
    assert res.exit_code == 0 and kube.watch_events_sent == 0 and relists >= 2


@pytest.mark.parametrize("how", ["event", "http"])
async def test_expired_resource_version_relists(fake: tuple[FakeKube, str], tmp_path: Path, how: str) -> None:
    kube, url = fake
    kube.expire_next_watch = how
    runner = make_runner(url, reconcile_interval_s=5.0)
    try:
        res = await runner.run(attempt(tmp_path, sleep=1), harness())
        relists = runner.tracker.relists
    finally:
        await runner.aclose()
    assert res.exit_code == 0 and kube.expired_sent == 1 and relists >= 2
    assert kube.watch_events_sent > 0  # the watch resumed after the relist and delivered completion


async def test_tracker_reads_transcribed_watch_lines(fake: tuple[FakeKube, str]) -> None:
    kube, url = fake
    kube.canned_watch = (HERE / "watch_events.jsonl").read_text().splitlines(keepends=True)
    runner = make_runner(url)
    tracker = JobTracker(runner.api, "default", "harnessrl.io/run=run-1", 1.0)
    seen: list[str] = []
    observe = tracker.observe

    def record(job: dict[str, Any]) -> None:
        seen.append(job["metadata"]["resourceVersion"])
        observe(job)

    tracker.observe = record  # type: ignore[method-assign]
    try:
        await tracker._watch("1000")  # ADDED, MODIFIED, DELETED, BOOKMARK, then the stream ends
    finally:
        await runner.aclose()
    assert seen == ["1102", "1109"] and tracker.gone == {"pi"} and "pi" not in tracker.jobs


async def test_job_creation_is_rate_limited(fake: tuple[FakeKube, str], tmp_path: Path) -> None:
    kube, url = fake
    now = [0.0]
    granted: list[float] = []

    async def fake_sleep(d: float) -> None:
        now[0] += d
        await asyncio.sleep(0)

    class Recording(TokenBucket):
        async def acquire(self) -> None:
            await super().acquire()
            granted.append(now[0])

    bucket = Recording(2.0, burst=1, clock=lambda: now[0], sleep=fake_sleep)
    runner = make_runner(url, rate=bucket)
    try:
        results = await asyncio.gather(
            *(runner.run(attempt(tmp_path, rid=f"ro{i}"), harness()) for i in range(4))
        )
    finally:
        await runner.aclose()
    assert all(r.exit_code == 0 for r in results) and len(kube.created_jobs) == 4
    gaps = [b - a for a, b in itertools.pairwise(granted)]
    assert len(granted) == 4 and all(g >= 0.5 - 1e-9 for g in gaps)  # 2 jobs/s, burst 1


async def test_cancel_deletes_the_job(fake: tuple[FakeKube, str], tmp_path: Path) -> None:
    kube, url = fake
    runner = make_runner(url)
    task = asyncio.create_task(runner.run(attempt(tmp_path, sleep=30), harness()))
    try:
        for _ in range(200):
            if kube.procs:
                break
            await asyncio.sleep(0.05)
        assert kube.procs, "the harness never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await runner.aclose()
    (name,) = kube.created_jobs
    assert kube.deleted_jobs == [(name, {"propagationPolicy": "Background"})]
    assert name not in kube.secrets


async def test_a_cancel_that_meets_a_job_event_still_deletes_the_job(
    fake: tuple[FakeKube, str], tmp_path: Path
) -> None:
    """A cancel that arrives in the same loop turn as an event about the Job (the tracker wakes the
    attempt's waiter, then the cancel comes) cancels the attempt. Python 3.11's `asyncio.wait_for`, once
    the awaitable it waits on has finished, returns its result instead of raising the cancel: the attempt
    ran on to its end and its Job was never deleted (how test_cancel_deletes_the_job failed, alone)."""
    kube, url = fake
    runner = make_runner(url)
    task = asyncio.create_task(runner.run(attempt(tmp_path, sleep=30), harness()))
    tracker, waiting, cancelled_at = runner.tracker, [False], []
    observe, wait = tracker.observe, tracker.wait

    async def wait_marked(name: str, timeout_s: float) -> None:
        waiting[0] = True
        try:
            await wait(name, timeout_s)
        finally:
            waiting[0] = False

    def observe_then_cancel(job: dict[str, Any]) -> None:
        observe(job)  # wakes the attempt's waiter
        if kube.procs and waiting[0] and not cancelled_at:
            cancelled_at.append(job["metadata"]["resourceVersion"])
            task.cancel()

    tracker.observe, tracker.wait = observe_then_cancel, wait_marked  # type: ignore[method-assign]
    try:
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await runner.aclose()
    assert cancelled_at, "the cancel never met an event"
    (name,) = kube.created_jobs
    assert kube.deleted_jobs == [(name, {"propagationPolicy": "Background"})]
    assert name not in kube.secrets


async def test_restarted_controller_adopts_instead_of_duplicating(
    fake: tuple[FakeKube, str], tmp_path: Path
) -> None:
    kube, url = fake
    first = make_runner(url)
    spec = attempt(tmp_path, sleep=1)
    running = asyncio.create_task(first.run(spec, harness()))
    second = make_runner(url)  # the "restarted" controller
    try:
        for _ in range(200):
            if kube.created_jobs:
                break
            await asyncio.sleep(0.05)
        (found,) = await second.list_attempt_jobs()
        assert (found.rollout_id, found.attempt, found.finished) == ("ro0123abcd", 1, False)
        adopted = await second.adopt(found, spec.workdir)
        assert adopted.exit_code == 0 and (adopted.output_dir / "answer.json").exists()
        resumed = await second.resume(spec, harness())  # what the Controller's reconcile calls
        assert resumed is not None and resumed.exit_code == 0
        gone = attempt(tmp_path / "other", n=7, sleep=0)
        assert await second.resume(gone, harness()) is None  # no Job of that attempt: lost
        again = await second.run(spec, harness())  # same attempt again: 409 → wait on the existing Job
        assert again.exit_code == 0 and len(kube.created_jobs) == 1
        assert (await running).exit_code == 0
    finally:
        await first.aclose()
        await second.aclose()


async def test_network_policy_allows_only_the_gateway(fake: tuple[FakeKube, str]) -> None:
    kube, url = fake
    runner = make_runner(url)
    try:
        await runner.ensure_network_policy(8000, gateway_pod_labels={"app": "harnessrl-gateway"})
        await runner.ensure_network_policy(8000, gateway_pod_labels={"app": "harnessrl-gateway"})  # 409 ok
    finally:
        await runner.aclose()
    (policy,) = kube.policies
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"harnessrl.io/run": "run-1"}}
    assert spec["policyTypes"] == ["Ingress", "Egress"] and spec["ingress"] == []
    gateway, dns = spec["egress"]
    assert gateway == {
        "to": [{"podSelector": {"matchLabels": {"app": "harnessrl-gateway"}}}],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert {p["port"] for p in dns["ports"]} == {53}
    by_ip = network_policy("hrl", None, 8000, gateway_cidr="10.0.0.5/32", allow_dns=False)
    assert by_ip["spec"]["egress"] == [
        {"to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}], "ports": [{"protocol": "TCP", "port": 8000}]}
    ]


def test_output_archive_is_checked(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    text, archive = split_log(f"out\n{OUTPUT_MARKER}{base64.b64encode(buf.getvalue()).decode()}\n")
    assert text == "out" and archive is not None
    with pytest.raises(tarfile.OutsideDestinationError):
        unpack_output(archive, tmp_path / "o", 1000)
    assert not (tmp_path / "escape.txt").exists()
    assert split_log("no marker here\n") == ("no marker here\n", None)


@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="set KUBECONFIG to run against a real cluster")
async def test_real_cluster_one_attempt(tmp_path: Path) -> None:
    """One attempt of a trivial harness (busybox) on a real cluster; see docs/kubernetes.md."""
    template = {
        "spec": {
            "containers": [
                {"name": "harness", "image": os.environ.get("HARNESSRL_K8S_IMAGE", "busybox:1.36")}
            ]
        }
    }
    access = ClusterAccess.from_kubeconfig()
    spec = KubernetesSpec(
        pod_template=template,
        run=f"test-{os.getpid()}",
        namespace=os.environ.get("HARNESSRL_K8S_NAMESPACE"),
        gateway_url="http://gateway.invalid:1",
        start_timeout_s=180,
        pod_check_interval_s=2,
        reconcile_interval_s=10,
    )
    runner = KubernetesRunner(spec, access)
    script = 'cp "$HARNESSRL_TASK" "$HARNESSRL_OUTPUT/answer.json"; echo "base=$OPENAI_BASE_URL"'
    try:
        res = await runner.run(attempt(tmp_path), HarnessSpec(["sh", "-c", script], timeout_s=120))
    finally:
        await runner.aclose()
    assert res.infra_error is None and res.exit_code == 0, res
    assert json.loads((res.output_dir / "answer.json").read_text())["a"] == 2
    assert "base=http://gateway.invalid:1/v1" in res.stdout_tail
