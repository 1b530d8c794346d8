"""deploy/kubernetes/scale.yaml is not applied to a cluster here (no API server runs on these machines);
what can be checked without one is: the gateway's arguments parse with its command line, the trainer's
overrides make a valid run config, and the names they use match the Services the manifest defines."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from harnessrl.cli import _parser
from harnessrl.config import load_config
from harnessrl.gateway.__main__ import parser as gateway_parser

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "scale.yaml"
RANKS = MANIFEST.parent / "trainer-ranks.yaml"
STORE = "postgresql://harnessrl:pw@harnessrl-postgres:5432/harnessrl"


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _secrets(obj: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The container's environment variables taken from a Secret: name -> (secret, key)."""
    container = obj["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in container.get("env", [])}
    return {name: (ref["name"], ref["key"]) for name, ref in refs.items() if ref}


def _command(obj: dict[str, Any]) -> list[str]:
    container = obj["spec"]["template"]["spec"]["containers"][0]
    secrets = _secrets(obj)
    # both the gateways and the trainer need the admin key, and the engine key: the gateways send it with
    # every engine request, the trainer's weight pushes send it (docs/scale.md, "Replicated gateways")
    assert secrets.keys() >= {"HARNESSRL_ADMIN_KEY", "HARNESSRL_ENGINE_KEY"}, secrets
    return [str(a).replace("$(HARNESSRL_STORE)", STORE) for a in container["command"]]


def _created_secret_keys(manifest: Path) -> set[str]:
    """The keys the header's `kubectl create secret generic harnessrl` command puts in the Secret."""
    return set(re.findall(r"--from-literal=([\w-]+)=", manifest.read_text().split("---")[0]))


def test_every_key_comes_from_the_secret_the_header_creates_and_the_engine_key_is_one_key() -> None:
    """The engine's key reaches vLLM (VLLM_API_KEY), the gateways and the trainer from one Secret entry,
    so the key the gateways send is the one vLLM checks; every Secret entry used is one the documented
    `kubectl create secret` makes, and no key is a plain env value."""
    created = _created_secret_keys(MANIFEST)
    objs = _objects()
    pods = {k: v for k, v in objs.items() if k[0] in ("StatefulSet", "Deployment", "Job")}
    ranks = [d for d in yaml.safe_load_all(RANKS.read_text()) if d and d["kind"] == "Job"]
    engine_key = _secrets(objs[("Deployment", "harnessrl-vllm")])["VLLM_API_KEY"]
    for obj in [*pods.values(), *ranks]:
        secrets = _secrets(obj)
        assert all(secret == "harnessrl" and key in created for secret, key in secrets.values()), secrets
        plain = {e["name"] for e in obj["spec"]["template"]["spec"]["containers"][0].get("env", [])
                 if "value" in e and "KEY" in e["name"]}  # fmt: skip
        assert not plain, (obj["metadata"]["name"], plain)
        if obj["metadata"]["name"] in ("harnessrl-gateway", "harnessrl-train"):
            assert secrets["HARNESSRL_ENGINE_KEY"] == engine_key, obj["metadata"]["name"]


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


def test_trainer_ranks_are_torchrun_nodes_of_one_sharded_run() -> None:
    """Each pod of the Indexed Job is a torchrun node whose rank is its index; pod 0's name is the
    rendezvous address; the arguments are a sharded run whose world size is the Job's pods."""
    from torch.distributed.run import get_args_parser

    docs = [d for d in yaml.safe_load_all(RANKS.read_text()) if d]
    objs = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    job = objs[("Job", "harnessrl-train")]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    service = objs[("Service", pod["subdomain"])]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert "job-completion-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    cmd = _command(job)
    assert cmd[0] == "torchrun"
    for index in range(spec["completions"]):
        args = get_args_parser().parse_args([a.replace("$(NODE_RANK)", str(index)) for a in cmd[1:]])
        assert (
            int(args.node_rank) == index and args.module and args.training_script == "harnessrl.trainer.rank"
        )
        assert args.master_addr == f"{job['metadata']['name']}-0.{pod['subdomain']}"
        assert int(args.nnodes) * int(args.nproc_per_node) == spec["completions"]
    ns = _parser().parse_args(args.training_script_args)
    cfg = load_config(None, ns.overrides)
    assert ns.command == "train" and cfg.train.world_size == spec["completions"]
    assert cfg.train.parallel == "fsdp" and cfg.train.device == "cuda" and cfg.store == STORE
    scale = _objects()
    assert ("StatefulSet", "harnessrl-gateway") in scale and ("Service", "harnessrl-vllm") in scale
    assert cfg.engine.url == "http://harnessrl-vllm:8000"
