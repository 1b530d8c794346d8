"""A guard's egress allowlist in the sandbox: each listed host:port is relayed the way the gateway is.

The sandbox has no network but its own loopback. For each allowed `host:port` the runner listens on a
Unix socket whose connections it pipes to that address (`GatewayBridge`), the socket is bound into the
sandbox, and `sandbox_init` listens on a loopback address there and relays to it:
- a loopback IP (`127.0.0.1:5432`) is served on that same address inside;
- a host name (`pypi.org:443`) gets a loopback address of its own (127.0.0.2, 127.0.0.3, ...), written
  first in the sandbox's `/etc/hosts`, so the harness connects to the name as usual (TLS included: the
  relay carries bytes, the name stays the one the harness asked for);
- any other IP address cannot be reached this way (nothing routes it inside): refused before the run.
Nothing else leaves the sandbox. Connections are resolved and opened on the host, by the runner.
"""

from __future__ import annotations

import contextlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from harnessrl.controller.runners.bridge import GatewayBridge

SOCKET_DIR_IN_SANDBOX = "/run/harnessrl"
HOSTS_IN_SANDBOX = "/etc/hosts"


@dataclass(frozen=True)
class Forward:
    """One allowed address: where the harness connects inside, and where the runner connects."""

    host: str  # as listed (a name or an IP)
    port: int
    inside: str  # the loopback address sandbox_init listens on

    @property
    def socket_name(self) -> str:
        return f"egress-{self.inside}-{self.port}.sock"


def plan(entries: list[str], gateway_port: int | None = None) -> list[Forward]:
    """The forwards of an egress allowlist (`host:port` each); `ValueError` naming an entry that cannot
    be relayed (an IP outside loopback, or the gateway's own in-sandbox address)."""
    names: dict[str, str] = {}
    out: list[Forward] = []
    for entry in dict.fromkeys(entries):
        host, _, port_s = entry.rpartition(":")
        host, port = host.strip("[]"), int(port_s)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None and not (ip.version == 4 and ip.is_loopback):
            raise ValueError(f"egress {entry!r}: only a host name or a 127.x.x.x address can be relayed "
                             "into the sandbox (nothing routes other addresses there); list the host's name")  # fmt: skip
        if host == "localhost":
            inside = "127.0.0.1"
        elif ip is not None:
            inside = str(ip)
        else:
            inside = names.setdefault(host, f"127.0.{(len(names) + 2) // 256}.{(len(names) + 2) % 256}")
        if inside == "127.0.0.1" and port == gateway_port:
            raise ValueError(f"egress {entry!r}: that is the gateway's address inside the sandbox")
        out.append(Forward(host, port, inside))
    return out


def hosts_text(forwards: list[Forward], host_hosts: Path = Path("/etc/hosts")) -> str:
    """The sandbox's `/etc/hosts`: the relayed names first (they win), then the host's own file."""
    lines = [f"{f.inside} {f.host}" for f in forwards if f.inside != f.host and f.host != "localhost"]
    own = ""
    with contextlib.suppress(OSError):
        own = host_hosts.read_text()
    return "".join(line + "\n" for line in dict.fromkeys(lines)) + own


class EgressRelay:
    """The host side of an attempt's egress: one bridge per allowed address, in `sock_dir`, and the
    bwrap mounts and `sandbox_init` options that make them reachable inside."""

    def __init__(self, forwards: list[Forward], sock_dir: Path) -> None:
        self.forwards, self.sock_dir = forwards, sock_dir
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> EgressRelay:
        for f in self.forwards:
            await self._stack.enter_async_context(
                GatewayBridge(self.sock_dir / f.socket_name, f.host, f.port)
            )
        if self.forwards:
            (self.sock_dir / "hosts").write_text(hosts_text(self.forwards))
            (self.sock_dir / "hosts").chmod(0o644)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def mounts(self) -> list[tuple[str, list[str]]]:
        """(mount point, bwrap options): each socket under /run/harnessrl, the hosts file."""
        out = []
        for f in self.forwards:
            inside = f"{SOCKET_DIR_IN_SANDBOX}/{f.socket_name}"
            out.append((inside, ["--ro-bind", str(self.sock_dir / f.socket_name), inside]))
        if self.forwards:
            out.append((HOSTS_IN_SANDBOX, ["--ro-bind", str(self.sock_dir / "hosts"), HOSTS_IN_SANDBOX]))
        return out

    def init_args(self) -> list[str]:
        """`--forward ADDR:PORT=SOCKET` for each allowed address (sandbox_init listens and relays)."""
        out: list[str] = []
        for f in self.forwards:
            out += ["--forward", f"{f.inside}:{f.port}={SOCKET_DIR_IN_SANDBOX}/{f.socket_name}"]
        return out
