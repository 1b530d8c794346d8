"""The Kubernetes runner: one Job per attempt, followed by a watch with a periodic relist.

How an attempt runs (see docs/kubernetes.md):
1. A Secret named like the Job holds the rollout's API key and the task input; the Job (built by
   `kubernetes_jobs.build_job` from the user's pod template) gets the key from it via `secretKeyRef`
   and mounts the task file. After the Job exists, the Secret is made owned by it (garbage-collected
   with it) and the runner also deletes it when the attempt ends. Job creation is rate limited.
2. One `JobTracker` per runner lists the run's Jobs, then watches them from the list's
   resourceVersion; every `reconcile_interval_s` (or when the watch drops, or on 410 Gone) it
   relists, so a missed event costs at most one interval.
3. While the Job has no running pod, its pods are checked every `pod_check_interval_s`: an image or
   container-config error, or no start within `start_timeout_s`, deletes the Job and returns
   `infra_error` (the Controller retries it as a new attempt).
4. When the Job finishes: Complete → exit 0; Failed with DeadlineExceeded → timed_out; Failed
   otherwise → the harness container's `terminated.exitCode` (none → infra_error). The pod log's
   last line carries the output directory (tar.gz, base64), unpacked into the local output dir.
5. Cancellation deletes the Job (propagationPolicy Background) and its Secret.

Restart safety: Job names are deterministic per (run, rollout, attempt), so re-running an attempt
after a controller restart finds the existing Job (409) and waits on it instead of starting another;
`list_attempt_jobs` and `adopt` let a restarted controller find and wait on its run's Jobs directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harnessrl.controller.runner import (
    AttemptResult,
    AttemptSpec,
    HarnessSpec,
    RunnerBase,
    pack_home,
    prepare_workdir,
)
from harnessrl.controller.runners.kubernetes_api import ClusterAccess, KubeApi, KubeApiError
from harnessrl.controller.runners.kubernetes_jobs import (
    ANN_ATTEMPT,
    ANN_ROLLOUT,
    LABEL_JOB,
    JobSettings,
    build_job,
    build_secret,
    job_condition,
    job_name,
    load_pod_template,
    network_policy,
    owner_patch,
    pod_problem,
    pod_started,
    run_selector,
    split_log,
    terminated_state,
    unpack_output,
)
from harnessrl.controller.runners.kubernetes_tracker import JobTracker, TokenBucket

log = logging.getLogger(__name__)
JSON = dict[str, Any]
API_ERRORS = (KubeApiError, httpx.HTTPError)


@dataclass(frozen=True)
class AttemptJob:
    """A Job of this run found in the cluster: which attempt it is and whether it has finished."""

    name: str
    rollout_id: str
    attempt: int
    finished: bool
    job: JSON = field(repr=False)


@dataclass
class KubernetesSpec:
    """How the runner uses the cluster. `pod_template`: see docs/kubernetes.md."""

    pod_template: JSON | str | Path
    run: str  # the run id: label `harnessrl.io/run` on every object, scope of list/watch
    namespace: str | None = None  # None = the access's namespace
    gateway_url: str | None = None  # the gateway as pods reach it (e.g. http://gateway.ns.svc:8000)
    container: str = "harness"
    ttl_seconds_after_finished: int = 600
    deadline_slack_s: float = 0.0
    work_size_limit: str | None = None
    jobs_per_s: float = 5.0  # Job creation rate limit
    burst: int = 10
    reconcile_interval_s: float = 30.0
    pod_check_interval_s: float = 10.0
    start_timeout_s: float = 300.0  # a pod not running by then is an infra error
    log_tail_lines: int = 5000


class KubernetesRunner(RunnerBase):
    """Runs each attempt as a Kubernetes Job; see the module docstring."""

    def __init__(
        self, spec: KubernetesSpec, access: ClusterAccess, rate_limiter: TokenBucket | None = None
    ) -> None:
        self.spec = spec
        self.api = KubeApi(access)
        self.namespace = spec.namespace or access.namespace
        self.template = load_pod_template(spec.pod_template)
        self.settings = JobSettings(
            namespace=self.namespace,
            run=spec.run,
            gateway_url=spec.gateway_url,
            container=spec.container,
            ttl_seconds_after_finished=spec.ttl_seconds_after_finished,
            deadline_slack_s=spec.deadline_slack_s,
            work_size_limit=spec.work_size_limit,
        )
        self.limiter = rate_limiter or TokenBucket(spec.jobs_per_s, spec.burst)
        self.tracker = JobTracker(self.api, self.namespace, run_selector(spec.run), spec.reconcile_interval_s)

    async def aclose(self) -> None:
        """Stop watching and close the API connections (Jobs keep running)."""
        await self.tracker.stop()
        await self.api.aclose()

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run one attempt as a Job to its end (exit, deadline, infrastructure failure)."""
        output_dir, _ = prepare_workdir(spec)
        name = job_name(self.spec.run, spec.rollout_id, spec.attempt)
        self.tracker.start()
        try:
            await self.limiter.acquire()
            try:
                job = await self._create(spec, harness, name)
            except (*API_ERRORS, ValueError) as e:
                await self._cleanup(name)
                return _infra(output_dir, f"could not create Job {name}: {e}")
            return await self._follow(job, output_dir, harness.max_output_bytes)
        except asyncio.CancelledError:
            log.info("event=k8s_attempt_cancelled job=%s deleting", name)
            await asyncio.shield(self._cleanup(name))
            raise

    async def adopt(self, job: AttemptJob, workdir: Path, max_output_bytes: int = 1_000_000) -> AttemptResult:
        """Wait on an existing Job of this run (after a controller restart) instead of starting one."""
        output_dir = workdir / "output"
        output_dir.mkdir(parents=True, exist_ok=True)
        self.tracker.start()
        try:
            return await self._follow(job.job, output_dir, max_output_bytes)
        except asyncio.CancelledError:
            await asyncio.shield(self._cleanup(job.name))
            raise

    async def resume(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult | None:
        """After a controller restart: wait on the Job of this attempt if it is still in the cluster
        (the Controller's reconcile calls this); None if it is gone, so the attempt counts as lost."""
        for job in await self.list_attempt_jobs():
            if job.rollout_id == spec.rollout_id and job.attempt == spec.attempt:
                return await self.adopt(job, spec.workdir, harness.max_output_bytes)
        return None

    async def list_attempt_jobs(self) -> list[AttemptJob]:
        """The run's Jobs in the cluster, finished or not (for reconciling after a restart)."""
        listing = await self.api.list_jobs(self.namespace, run_selector(self.spec.run))
        found = []
        for j in listing.get("items") or []:
            ann = j["metadata"].get("annotations") or {}
            if ANN_ROLLOUT not in ann:
                continue
            found.append(
                AttemptJob(
                    j["metadata"]["name"],
                    ann[ANN_ROLLOUT],
                    int(ann.get(ANN_ATTEMPT, 0)),
                    job_condition(j) is not None,
                    j,
                )
            )
        return found

    async def ensure_network_policy(self, gateway_port: int, **peer: Any) -> JSON:
        """Create the run's gateway-only NetworkPolicy (see `kubernetes_jobs.network_policy`) if absent."""
        body = network_policy(self.namespace, self.spec.run, gateway_port, **peer)
        try:
            return await self.api.create_network_policy(self.namespace, body)
        except KubeApiError as e:
            if e.status != 409:
                raise
            return body

    # -- steps ---------------------------------------------------------------------------------------
    async def _create(self, spec: AttemptSpec, harness: HarnessSpec, name: str) -> JSON:
        home = pack_home(spec.workdir)  # harness.files, unpacked into the pod's home/
        job_body = build_job(self.settings, self.template, spec, harness, name, with_home=bool(home))
        try:
            await self.api.create_secret(self.namespace, build_secret(self.settings, spec, name, home))
        except KubeApiError as e:
            if e.status != 409:  # 409: left by an earlier controller for this same attempt
                raise
        try:
            job = await self.api.create_job(self.namespace, job_body)
            log.info(
                "event=k8s_job_created job=%s rollout=%s attempt=%d", name, spec.rollout_id, spec.attempt
            )
        except KubeApiError as e:
            if e.status != 409:
                raise
            job = await self.api.get_job(self.namespace, name)
            log.info("event=k8s_job_adopted job=%s (already existed)", name)
        try:
            await self.api.patch_secret(self.namespace, name, owner_patch(job))
        except API_ERRORS as e:  # the Secret is still deleted when the attempt ends
            log.warning("event=k8s_secret_owner_failed job=%s error=%s", name, e)
        return job

    async def _follow(self, job: JSON, output_dir: Path, max_output_bytes: int) -> AttemptResult:
        name = job["metadata"]["name"]
        self.tracker.observe(job)
        try:
            final = await self._wait_finished(name)
            if isinstance(final, str):
                await self._cleanup(name)
                return _infra(output_dir, final)
            return await self._result(final, output_dir, max_output_bytes)
        finally:
            self.tracker.forget(name)
            with contextlib.suppress(*API_ERRORS):
                await self.api.delete_secret(self.namespace, name)

    async def _wait_finished(self, name: str) -> JSON | str:
        """The finished Job, or why it will not finish (an infrastructure error message)."""
        begun, started = time.monotonic(), False
        while True:
            if name in self.tracker.gone:
                return f"Job {name} was deleted before it finished"
            job = self.tracker.jobs.get(name)
            if job is not None and job_condition(job) is not None:
                return job
            if not started and job is not None and (job.get("status") or {}).get("ready"):
                started = True
            if not started:
                problem, started = await self._check_pods(name, time.monotonic() - begun)
                if problem:
                    return problem
            await self.tracker.wait(name, self.spec.pod_check_interval_s)

    async def _check_pods(self, name: str, elapsed_s: float) -> tuple[str | None, bool]:
        """(an infra error message or None, whether the pod has started)."""
        try:
            pods = await self.api.list_pods(self.namespace, f"{LABEL_JOB}={name}")
        except API_ERRORS as e:
            log.warning("event=k8s_pod_check_failed job=%s error=%s", name, e)
            pods = []
        late = elapsed_s > self.spec.start_timeout_s
        for pod in pods:
            if pod_started(pod):
                return None, True
            found = pod_problem(pod, self.spec.container)
            if found and (found[1] or late):
                return f"pod {pod['metadata']['name']} cannot start: {found[0]}", False
        if late:
            return f"Job {name} has no running pod after {self.spec.start_timeout_s:.0f}s", False
        return None, False

    async def _result(self, job: JSON, output_dir: Path, max_output_bytes: int) -> AttemptResult:
        name = job["metadata"]["name"]
        cond = job_condition(job) or {}
        timed_out = cond.get("type") == "Failed" and cond.get("reason") == "DeadlineExceeded"
        try:
            pods = await self.api.list_pods(self.namespace, f"{LABEL_JOB}={name}")
        except API_ERRORS as e:
            return _infra(output_dir, f"could not list the pods of Job {name}: {e}")
        finished = [(p, t) for p in pods if (t := terminated_state(p, self.spec.container)) is not None]
        exit_code: int | None = 0 if cond.get("type") == "Complete" else None
        log_text = ""
        if finished:
            pod, term = finished[-1]
            exit_code = int(term.get("exitCode", 0)) if not timed_out else None
            try:
                log_text = await self.api.read_pod_log(
                    self.namespace, pod["metadata"]["name"], self.spec.container, self.spec.log_tail_lines
                )
            except API_ERRORS as e:
                if not timed_out:
                    return _infra(output_dir, f"could not read the log of pod {pod['metadata']['name']}: {e}")
        if not timed_out and exit_code is None:
            return _infra(
                output_dir,
                f"Job {name} failed without a harness exit code: {cond.get('reason')}: {cond.get('message')}",
            )
        stdout, archive = split_log(log_text)
        if archive is None and not timed_out:
            log.warning("event=k8s_no_output_marker job=%s (output files lost)", name)
        try:
            unpack_output(archive or b"", output_dir, max_output_bytes)
        except (ValueError, OSError, EOFError) as e:
            log.warning("event=k8s_output_unpack_failed job=%s error=%s", name, e)
        log.info("event=k8s_attempt_done job=%s exit=%s timed_out=%s", name, exit_code, timed_out)
        return AttemptResult(exit_code, timed_out, output_dir, stdout[-max_output_bytes:], "")

    async def _cleanup(self, name: str) -> None:
        for delete in (self.api.delete_job, self.api.delete_secret):
            try:
                await delete(self.namespace, name)
            except API_ERRORS as e:
                log.warning("event=k8s_cleanup_failed name=%s error=%s", name, e)


def _infra(output_dir: Path, message: str) -> AttemptResult:
    log.warning("event=k8s_attempt_infra_error error=%s", message)
    return AttemptResult(None, False, output_dir, "", "", infra_error=message)
