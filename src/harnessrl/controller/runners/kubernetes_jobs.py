"""Pure translation for the Kubernetes runner: attempt → Job + Secret, NetworkPolicy, Job/Pod → result.

No I/O here (except unpacking output files into a directory); `kubernetes.py` does the API calls.

The pod template (the user's part) is a Job's `spec.template`: `{"metadata": {...}, "spec": PodSpec}`
with one container named `harness` (or the first container) carrying the harness image. That
container's `command` + `args` is the harness command; without a `command` the runner uses
`HarnessSpec.command`. The runner wraps it in `WRAPPER` (POSIX sh; needs `tar`, `gzip`, `base64` in
the image — busybox, Debian, Alpine and the python images have them) so that at exit the output
directory comes back in the container log as one line: `OUTPUT_MARKER` + base64(tar.gz).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import io
import json
import math
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harnessrl.controller.runner import AttemptSpec, HarnessSpec, contract_env

JSON = dict[str, Any]

LABEL_RUN = "harnessrl.io/run"
LABEL_ROLLOUT = "harnessrl.io/rollout"
LABEL_ATTEMPT = "harnessrl.io/attempt"
LABEL_JOB = "harnessrl.io/job"  # on the pods, to find a Job's pods without the controller-uid
ANN_ROLLOUT, ANN_ATTEMPT, ANN_RUN = (
    "harnessrl.io/rollout-id",
    "harnessrl.io/attempt-number",
    "harnessrl.io/run-id",
)
SECRET_KEY, SECRET_TASK, SECRET_HOME = "api-key", "task.json", "home.tgz"
MAX_HOME_BYTES = 700 << 10  # the packed harness.files must fit a Secret (1 MiB, base64 included)
INPUT_DIR, WORK_DIR = "/harnessrl/input", "/harnessrl/work"
OUTPUT_MARKER = "HARNESSRL-OUTPUT-TGZ:"

# $1.. = the harness command. Unpacks harness.files into home/ and runs it there (the working directory
# of every runner), keeps its exit code, then prints the output dir as one line.
WRAPPER = (
    f'mkdir -p "$HARNESSRL_OUTPUT" "$HOME" "{WORK_DIR}/home"; '
    f'if [ -f "{INPUT_DIR}/{SECRET_HOME}" ]; then tar -xzf "{INPUT_DIR}/{SECRET_HOME}" -C "{WORK_DIR}/home"; fi; '
    f'cd "{WORK_DIR}/home" || exit 125; "$@"; code=$?; '
    f"printf '\\n{OUTPUT_MARKER}'; "
    '(cd "$HARNESSRL_OUTPUT" && tar -czf - . 2>/dev/null | base64 | tr -d "\\n"); '
    "printf '\\n'; exit $code"
)
IMAGE_ERRORS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


def load_pod_template(template: JSON | str | Path) -> JSON:
    """A pod template from a dict, a YAML/JSON string, or a YAML/JSON file path."""
    if isinstance(template, dict):
        return copy.deepcopy(template)
    text = template.read_text() if isinstance(template, Path) else template
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or not isinstance(data.get("spec"), dict):
        raise ValueError("pod template must be a mapping with a `spec` (a PodSpec) and optional `metadata`")
    return data


def label_value(value: str) -> str:
    """A string made into a valid label value (≤63 chars of [A-Za-z0-9-_.], alphanumeric ends)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:63]
    return cleaned.strip("-_.") or "x"


def job_name(run: str, rollout_id: str, attempt: int) -> str:
    """The deterministic Job (and Secret) name of an attempt: a restart that recreates it gets 409."""
    digest = hashlib.sha256(f"{run}/{rollout_id}/{attempt}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9-]", "-", rollout_id.lower())[:30].strip("-")
    return f"hrl-{slug}-{attempt}-{digest}" if slug else f"hrl-{attempt}-{digest}"


def attempt_labels(run: str, rollout_id: str, attempt: int) -> dict[str, str]:
    """The labels every object of an attempt carries."""
    return {
        LABEL_RUN: label_value(run),
        LABEL_ROLLOUT: label_value(rollout_id),
        LABEL_ATTEMPT: str(attempt),
    }


def run_selector(run: str) -> str:
    """The label selector of all of a run's Jobs."""
    return f"{LABEL_RUN}={label_value(run)}"


@dataclass(frozen=True)
class JobSettings:
    """What the runner sets on each Job besides the template."""

    namespace: str
    run: str
    gateway_url: str | None = None  # the gateway as pods reach it; None = the AttemptSpec's URL
    container: str = "harness"
    ttl_seconds_after_finished: int = 600
    deadline_slack_s: float = 0.0  # added to the harness timeout (scheduling + image pull count too)
    work_size_limit: str | None = None  # sizeLimit of the emptyDir holding output/ and home/


def build_secret(settings: JobSettings, spec: AttemptSpec, name: str, home: bytes = b"") -> JSON:
    """The per-attempt Secret: the rollout's API key, the task input and the packed `harness.files`
    (`home`, from `runner.pack_home`; mounted as files). Raises ValueError when those are too big."""
    data = {
        SECRET_KEY: base64.b64encode(spec.api_key.encode()).decode(),
        SECRET_TASK: base64.b64encode(json.dumps(spec.task_input).encode()).decode(),
    }
    if len(home) > MAX_HOME_BYTES:
        raise ValueError(f"harness.files pack to {len(home)} bytes, more than a Secret holds "
                         f"({MAX_HOME_BYTES}); put large files in the pod template's image instead")  # fmt: skip
    if home:
        data[SECRET_HOME] = base64.b64encode(home).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": attempt_labels(settings.run, spec.rollout_id, spec.attempt),
        },
        "type": "Opaque",
        "data": data,
    }


def owner_patch(job: JSON) -> JSON:
    """A merge patch that makes the Secret owned by its Job (deleted with it by the garbage collector)."""
    meta = job["metadata"]
    ref = {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}
    return {"metadata": {"ownerReferences": [ref]}}


def harness_container(pod_spec: JSON, name: str) -> JSON:
    """The container that runs the harness: the one named `name`, else the first."""
    containers = pod_spec.get("containers") or []
    if not containers:
        raise ValueError("pod template has no containers; add one with the harness image")
    for c in containers:
        if c.get("name") == name:
            return c  # type: ignore[no-any-return]
    return containers[0]  # type: ignore[no-any-return]


def container_env(settings: JobSettings, spec: AttemptSpec, harness: HarnessSpec, secret: str) -> list[JSON]:
    """The harness contract as container env; every value equal to the API key comes from the Secret."""
    cluster_spec = dataclasses.replace(spec, gateway_url=settings.gateway_url or spec.gateway_url)
    env = contract_env(
        cluster_spec,
        dataclasses.replace(harness, passthrough=()),  # the controller's PATH etc. mean nothing in a pod
        Path(INPUT_DIR) / SECRET_TASK,
        Path(WORK_DIR) / "output",
    )
    env["HOME"] = f"{WORK_DIR}/home"
    out: list[JSON] = []
    for key, value in env.items():
        if value == spec.api_key:
            out.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": SECRET_KEY}}})
        else:
            out.append({"name": key, "value": value})
    return out


def build_job(
    settings: JobSettings, template: JSON, spec: AttemptSpec, harness: HarnessSpec, name: str,
    with_home: bool = False,
) -> JSON:  # fmt: skip
    """The Job of one attempt: the template plus labels, deadline, TTL, no retries, wrapped command."""
    pod = copy.deepcopy(template)
    pod_meta, pod_spec = pod.setdefault("metadata", {}), pod.setdefault("spec", {})
    labels = attempt_labels(settings.run, spec.rollout_id, spec.attempt)
    pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **labels, LABEL_JOB: name}
    pod_spec["restartPolicy"] = "Never"
    pod_spec.setdefault("automountServiceAccountToken", False)
    container = harness_container(pod_spec, settings.container)
    command = list(container.get("command") or harness.command) + (
        list(container.get("args") or []) if container.get("command") else []
    )
    if not command:
        raise ValueError("no harness command: set the container's `command` or HarnessSpec.command")
    container["command"] = ["/bin/sh", "-c", WRAPPER, "harnessrl-harness", *command]
    container.pop("args", None)
    ours = container_env(settings, spec, harness, name)
    names = {e["name"] for e in ours}
    container["env"] = [e for e in container.get("env") or [] if e.get("name") not in names] + ours
    container["volumeMounts"] = [
        *(container.get("volumeMounts") or []),
        {"name": "harnessrl-input", "mountPath": INPUT_DIR, "readOnly": True},
        {"name": "harnessrl-work", "mountPath": WORK_DIR},
    ]
    empty_dir: JSON = {"sizeLimit": settings.work_size_limit} if settings.work_size_limit else {}
    secret_files = [SECRET_TASK, SECRET_HOME] if with_home else [SECRET_TASK]
    pod_spec["volumes"] = [
        *(pod_spec.get("volumes") or []),
        {
            "name": "harnessrl-input",
            "secret": {"secretName": name, "items": [{"key": k, "path": k} for k in secret_files]},
        },
        {"name": "harnessrl-work", "emptyDir": empty_dir},
    ]
    annotations = {ANN_ROLLOUT: spec.rollout_id, ANN_ATTEMPT: str(spec.attempt), ANN_RUN: settings.run}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": max(1, math.ceil(harness.timeout_s + settings.deadline_slack_s)),
            "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
            "template": pod,
        },
    }


def network_policy(
    namespace: str,
    run: str | None,
    gateway_port: int,
    gateway_pod_labels: dict[str, str] | None = None,
    gateway_namespace_labels: dict[str, str] | None = None,
    gateway_cidr: str | None = None,
    allow_dns: bool = True,
) -> JSON:
    """A NetworkPolicy for harness pods (of `run`, or of every run when None): no ingress, egress
    only to the gateway (its pods by label, or an IP block) on its port, plus cluster DNS if asked."""
    if (gateway_pod_labels is None) == (gateway_cidr is None):
        raise ValueError("give exactly one of gateway_pod_labels or gateway_cidr")
    peer: JSON
    if gateway_cidr is not None:
        peer = {"ipBlock": {"cidr": gateway_cidr}}
    else:
        peer = {"podSelector": {"matchLabels": dict(gateway_pod_labels or {})}}
        if gateway_namespace_labels is not None:
            peer["namespaceSelector"] = {"matchLabels": dict(gateway_namespace_labels)}
    egress: list[JSON] = [{"to": [peer], "ports": [{"protocol": "TCP", "port": gateway_port}]}]
    if allow_dns:
        dns_peer = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
        egress.append(
            {"to": [dns_peer], "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
        )
    selector: JSON = (
        {"matchLabels": {LABEL_RUN: label_value(run)}}
        if run is not None
        else {"matchExpressions": [{"key": LABEL_ROLLOUT, "operator": "Exists"}]}
    )
    name = (
        f"harnessrl-{label_value(run).lower().replace('_', '-').replace('.', '-')[:40]}"
        if run
        else "harnessrl"
    )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-gateway-only", "namespace": namespace},
        "spec": {
            "podSelector": selector,
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": egress,
        },
    }


# -- reading Jobs and Pods back -------------------------------------------------------------------
def job_condition(job: JSON) -> JSON | None:
    """The terminal condition (Complete or Failed, status True) of a Job, None while it runs."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond  # type: ignore[no-any-return]
    return None


def terminated_state(pod: JSON, container: str) -> JSON | None:
    """The harness container's `state.terminated` in a Pod, if it has one."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container:
            return (cs.get("state") or {}).get("terminated")  # type: ignore[no-any-return]
    return None


def pod_started(pod: JSON) -> bool:
    """Whether the pod got past scheduling and image pulling (running or finished)."""
    return (pod.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed")


def pod_problem(pod: JSON, container: str) -> tuple[str, bool] | None:
    """Why a pod cannot start: (message, fatal now). Image/config errors are fatal at once;
    Unschedulable only once the start timeout has passed (the cluster may scale up)."""
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if cs.get("name") == container and waiting.get("reason") in IMAGE_ERRORS:
            return f"{waiting['reason']}: {waiting.get('message', '')}".strip(": "), True
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{cond.get('reason', 'Unschedulable')}: {cond.get('message', '')}", False
    return None


def split_log(log_text: str) -> tuple[str, bytes | None]:
    """Split a container log into (the harness's output, the output archive or None if absent)."""
    head, sep, rest = log_text.rpartition("\n" + OUTPUT_MARKER)
    if not sep:
        if log_text.startswith(OUTPUT_MARKER):
            head, rest = "", log_text[len(OUTPUT_MARKER) :]
        else:
            return log_text, None
    try:
        return head, base64.b64decode(rest.strip(), validate=True) if rest.strip() else b""
    except ValueError:
        return head, None


def unpack_output(archive: bytes, output_dir: Path, max_bytes: int) -> int:
    """Unpack the output tar.gz into `output_dir` (regular files and dirs only, no escapes); returns
    the number of bytes written. Raises ValueError if it holds more than `max_bytes`."""
    if not archive:
        return 0
    output_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        total = sum(m.size for m in members)
        if total > max_bytes:
            raise ValueError(f"output files hold {total} bytes, more than the limit {max_bytes}")
        tar.extractall(output_dir, members=members, filter="data")
    return total
