"""A small Kubernetes REST client over httpx: only the calls the Kubernetes runner needs.

Surface: create/get/delete/list/watch Jobs, create/patch/delete Secrets, list Pods, read a Pod's log,
create a NetworkPolicy. Credentials come from the in-cluster service account (token + CA, the token
file re-read when it rotates) or from a kubeconfig (server, token or client certificate, CA).
An error answer of the API server becomes `KubeApiError` with the `Status` object's reason and message.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
JSON = dict[str, Any]


class KubeApiError(Exception):
    """The API server answered with an error (`status` is the HTTP code, `reason` the Status reason)."""

    def __init__(self, status: int, reason: str, message: str, body: JSON | None = None) -> None:
        super().__init__(f"kubernetes API {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}


@dataclass(frozen=True)
class ClusterAccess:
    """Where the API server is and how to authenticate to it."""

    server: str
    namespace: str = "default"
    token: str | None = None
    token_file: str | None = None  # re-read when it changes (projected service account tokens rotate)
    ca_file: str | None = None
    client_cert: tuple[str, str] | None = None  # (certificate file, key file)
    verify: bool = True

    @classmethod
    def in_cluster(cls) -> ClusterAccess:
        """The pod's own service account: KUBERNETES_SERVICE_HOST/PORT, its token, CA and namespace."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise RuntimeError("not in a cluster: KUBERNETES_SERVICE_HOST/PORT are unset; pass a kubeconfig")
        host = f"[{host}]" if ":" in host else host
        ns_file = SA_DIR / "namespace"
        namespace = ns_file.read_text().strip() if ns_file.exists() else "default"
        return cls(
            server=f"https://{host}:{port}",
            namespace=namespace,
            token_file=str(SA_DIR / "token"),
            ca_file=str(SA_DIR / "ca.crt"),
        )

    @classmethod
    def from_kubeconfig(cls, path: str | None = None, context: str | None = None) -> ClusterAccess:
        """Read server, namespace and credentials of a kubeconfig context (default: current-context).

        Supports token, tokenFile, client-certificate(-data)/client-key(-data), certificate-authority
        (-data) and insecure-skip-tls-verify; exec/auth-provider plugins are not supported."""
        path = path or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or "~/.kube/config"
        cfg = yaml.safe_load(Path(path).expanduser().read_text())
        name = context or cfg.get("current-context")
        ctx = _named(cfg.get("contexts", []), name, "context")
        cluster = _named(cfg.get("clusters", []), ctx["cluster"], "cluster")
        user = _named(cfg.get("users", []), ctx.get("user"), "user") if ctx.get("user") else {}
        if "exec" in user or "auth-provider" in user:
            raise RuntimeError(
                f"kubeconfig user of context {name!r} uses an exec/auth-provider plugin; "
                "use a token or client certificate (e.g. a service account token)"
            )
        cert = _file_or_data(user, "client-certificate")
        key = _file_or_data(user, "client-key")
        return cls(
            server=str(cluster["server"]).rstrip("/"),
            namespace=ctx.get("namespace", "default"),
            token=user.get("token"),
            token_file=user.get("tokenFile"),
            ca_file=_file_or_data(cluster, "certificate-authority"),
            client_cert=(cert, key) if cert and key else None,
            verify=not cluster.get("insecure-skip-tls-verify", False),
        )


def _named(items: list[JSON], name: str | None, what: str) -> JSON:
    for item in items:
        if item.get("name") == name:
            return dict(item.get(what, {}))
    raise RuntimeError(f"kubeconfig has no {what} named {name!r}")


def _file_or_data(section: JSON, key: str) -> str | None:
    """A kubeconfig `<key>` path, or `<key>-data` (base64) written to a private temporary file."""
    if section.get(key):
        return str(section[key])
    data = section.get(f"{key}-data")
    if not data:
        return None
    fd, name = tempfile.mkstemp(prefix="harnessrl-kube-", suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64decode(data))
    return name


class _BearerAuth(httpx.Auth):
    """Adds `Authorization: Bearer`; a token file is re-read whenever its mtime changes."""

    def __init__(self, token: str | None, token_file: str | None) -> None:
        self._token, self._file, self._mtime = token, token_file, 0.0

    def auth_flow(self, request: httpx.Request):  # type: ignore[no-untyped-def]
        if self._file:
            mtime = os.stat(self._file).st_mtime
            if mtime != self._mtime:
                self._token, self._mtime = Path(self._file).read_text().strip(), mtime
        if self._token:
            request.headers["Authorization"] = f"Bearer {self._token}"
        yield request


class KubeApi:
    """The handful of Kubernetes API calls the runner makes, over one pooled httpx client."""

    def __init__(self, access: ClusterAccess, timeout_s: float = 30.0) -> None:
        self.access = access
        verify: bool | str = access.ca_file if (access.verify and access.ca_file) else access.verify
        self._http = httpx.AsyncClient(
            base_url=access.server,
            auth=_BearerAuth(access.token, access.token_file),
            verify=verify,
            cert=access.client_cert,
            timeout=timeout_s,
            headers={"Accept": "application/json"},
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = await self._http.request(method, path, **kw)
        if r.status_code >= 400:
            raise _error(r.status_code, r.content)
        return r

    # -- Jobs ---------------------------------------------------------------------------------------
    @staticmethod
    def jobs_path(ns: str, name: str = "") -> str:
        """The REST path of a namespace's Jobs (or of one Job)."""
        return f"/apis/batch/v1/namespaces/{ns}/jobs" + (f"/{name}" if name else "")

    async def create_job(self, ns: str, job: JSON) -> JSON:
        """POST a Job; returns the created object."""
        return (await self._call("POST", self.jobs_path(ns), json=job)).json()  # type: ignore[no-any-return]

    async def get_job(self, ns: str, name: str) -> JSON:
        """GET one Job."""
        return (await self._call("GET", self.jobs_path(ns, name))).json()  # type: ignore[no-any-return]

    async def delete_job(self, ns: str, name: str) -> None:
        """DELETE a Job and (in the background) its Pods; a Job already gone is fine."""
        try:
            await self._call("DELETE", self.jobs_path(ns, name), params={"propagationPolicy": "Background"})
        except KubeApiError as e:
            if e.status != 404:
                raise

    async def list_jobs(self, ns: str, selector: str) -> JSON:
        """LIST Jobs by label selector; the JobList carries `metadata.resourceVersion` for a watch."""
        r = await self._call("GET", self.jobs_path(ns), params={"labelSelector": selector})
        return r.json()  # type: ignore[no-any-return]

    async def watch_jobs(
        self, ns: str, selector: str, resource_version: str, timeout_s: int
    ) -> AsyncIterator[JSON]:
        """Watch Jobs from a resourceVersion: yields `{"type", "object"}` events (one JSON per line).

        The server ends the stream after `timeout_s`; an expired version arrives as an ERROR event
        whose object is a Status with code 410 (or as an HTTP 410), and is raised as `KubeApiError`."""
        params = {
            "watch": "true",
            "labelSelector": selector,
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_s),
            "allowWatchBookmarks": "true",
        }
        timeout = httpx.Timeout(self._http.timeout.connect, read=timeout_s + 30.0)
        async with self._http.stream("GET", self.jobs_path(ns), params=params, timeout=timeout) as r:
            if r.status_code >= 400:
                raise _error(r.status_code, await r.aread())
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    raise _status_error(obj)
                yield event

    # -- Secrets, Pods, NetworkPolicies -------------------------------------------------------------
    async def create_secret(self, ns: str, secret: JSON) -> JSON:
        """POST a Secret."""
        r = await self._call("POST", f"/api/v1/namespaces/{ns}/secrets", json=secret)
        return r.json()  # type: ignore[no-any-return]

    async def patch_secret(self, ns: str, name: str, patch: JSON) -> JSON:
        """JSON merge-patch a Secret (used to set its ownerReferences)."""
        r = await self._call(
            "PATCH",
            f"/api/v1/namespaces/{ns}/secrets/{name}",
            content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return r.json()  # type: ignore[no-any-return]

    async def delete_secret(self, ns: str, name: str) -> None:
        """DELETE a Secret; one already gone is fine."""
        try:
            await self._call("DELETE", f"/api/v1/namespaces/{ns}/secrets/{name}")
        except KubeApiError as e:
            if e.status != 404:
                raise

    async def list_pods(self, ns: str, selector: str) -> list[JSON]:
        """LIST Pods by label selector; returns the items."""
        r = await self._call("GET", f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector})
        return list(r.json().get("items") or [])

    async def read_pod_log(self, ns: str, pod: str, container: str, tail_lines: int) -> str:
        """The last `tail_lines` lines of a container's log (stdout and stderr interleaved)."""
        r = await self._call(
            "GET",
            f"/api/v1/namespaces/{ns}/pods/{pod}/log",
            params={"container": container, "tailLines": str(tail_lines)},
            headers={"Accept": "*/*"},
        )
        return r.text

    async def create_network_policy(self, ns: str, policy: JSON) -> JSON:
        """POST a NetworkPolicy."""
        r = await self._call(
            "POST", f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies", json=policy
        )
        return r.json()  # type: ignore[no-any-return]


def _error(status: int, content: bytes) -> KubeApiError:
    try:
        body = json.loads(content)
    except ValueError:
        return KubeApiError(status, "", content[:500].decode("utf-8", "replace"))
    if isinstance(body, dict) and body.get("kind") == "Status":
        return _status_error(body, status)
    return KubeApiError(status, "", content[:500].decode("utf-8", "replace"))


def _status_error(status: JSON, code: int | None = None) -> KubeApiError:
    """A `Status` object (an error body, or the object of a watch ERROR event) as an exception."""
    return KubeApiError(
        int(status.get("code") or code or 500),
        str(status.get("reason", "")),
        str(status.get("message", "")),
        status,
    )
