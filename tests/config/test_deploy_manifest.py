"""deploy/kubernetes/scale.yaml is not applied to a cluster here (no API server runs on these machines);
what can be checked without one is: the gateway's arguments parse with its command line, the trainer's
overrides make a valid run config, and the names they use match the Services the manifest defines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from harnessrl.cli import _parser
from harnessrl.config import load_config
from harnessrl.gateway.__main__ import parser as gateway_parser

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "scale.yaml"
STORE = "postgresql://harnessrl:pw@harnessrl-postgres:5432/harnessrl"


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _command(obj: dict[str, Any]) -> list[str]:
    container = obj["spec"]["template"]["spec"]["containers"][0]
    env_names = {e["name"] for e in container.get("env", [])}
    assert "HARNESSRL_ADMIN_KEY" in env_names  # both the gateways and the trainer need the admin key
    return [str(a).replace("$(HARNESSRL_STORE)", STORE) for a in container["command"]]


def test_gateway_replicas_parse_and_are_addressable_one_by_one() -> None:
    objs = _objects()
    gw = objs[("StatefulSet", "harnessrl-gateway")]
    cmd = _command(gw)
    assert cmd[:3] == ["python", "-m", "harnessrl.gateway"]
    args = gateway_parser().parse_args(cmd[3:])
    assert args.store == STORE and args.host == "0.0.0.0" and args.port == 8000
    assert args.upstream == "http://harnessrl-vllm:8000" and ("Service", "harnessrl-vllm") in objs
    headless = objs[("Service", gw["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"  # each replica gets its own DNS name

    train = _command(objs[("Job", "harnessrl-train")])
    ns = _parser().parse_args(train[1:])
    assert (
        train[0] == "harnessrl" and ns.command == "train" and ns.config == Path("/runs/project/config.yaml")
    )
    cfg = load_config(None, ns.overrides)
    replicas = gw["spec"]["replicas"]
    assert cfg.gateway.urls == [
        f"http://harnessrl-gateway-{i}.harnessrl-gateway:{args.port}" for i in range(replicas)
    ]
    assert cfg.store == STORE and cfg.engine.kind == "vllm" and cfg.engine.url == args.upstream
