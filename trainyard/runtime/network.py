"""The interface a multi-node run's workers listen on, where the host's name does not say it.

Gloo and TensorPipe listen on the address this host's name resolves to. Where it resolves to
loopback (Debian's `127.0.1.1 <hostname>` line) or to nothing, Gloo falls back to loopback
("Unable to resolve hostname to a (local) address. Using the loopback address as fallback")
and the other nodes, told 127.0.0.1, never connect: node 0 restarts in a loop with "Gloo
connectFullMesh failed". Both read the interface from an environment variable instead:
this module names the one the kernel routes to the rendezvous endpoint through."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import time

SOCKET_INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def listening_interface(endpoint: str | None) -> tuple[str, str] | None:
    """(interface, its address) for the workers of a run whose rendezvous is at `endpoint`
    (host:port), where this host's name leads them to loopback; None where it does not,
    where every node is on this machine (the endpoint on loopback), or where the user
    named the interface already."""
    host = endpoint_host_port(endpoint)[0] if endpoint else ""
    if not host or any(os.environ.get(name) for name in SOCKET_INTERFACE_ENVS):
        return None
    if _name_resolves_to_this_machine():
        return None
    try:
        local = address_towards(host)
    except OSError:  # no route to it (yet): Gloo will say so itself
        return None
    if ipaddress.ip_address(local).is_loopback:
        return None
    name = _interface_with(local)
    return None if name is None else (name, local)


def interface_env(interface: str) -> dict[str, str]:
    return dict.fromkeys(SOCKET_INTERFACE_ENVS, interface)


def _name_resolves_to_this_machine() -> bool:
    """Whether the host name resolves to an address of this machine other than loopback
    (one Gloo can listen on and the other nodes can reach)."""
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return False
    for *_, (address, *_) in found:
        if ipaddress.ip_address(address).is_loopback:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address, 0))  # an address of this machine: bindable
            except OSError:
                continue
            return True
    return False


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (OSError where it has none): a UDP
    connect sends nothing, it only picks the route."""
    family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def _interface_with(address: str) -> str | None:
    """The interface holding IPv4 `address` (None for an IPv6 one: Gloo's name suffices)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def endpoint_host_port(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    """(host, port) of train.rdzv_endpoint as torchrun reads it (parse_rendezvous_endpoint):
    "10.0.0.1:29400", "node-a" (its default port), "[fd00::1]:29400", and "fd00::1:29400",
    whose last colon starts the port."""
    if endpoint.startswith("["):
        host, _, port = endpoint[1:].partition("]")
        return host, int(port.lstrip(":") or default_port)
    host, colon, port = endpoint.rpartition(":")
    if not colon or not port.isdigit():
        return endpoint, default_port
    return host, int(port)


def unanswered(endpoint: str, timeout_s: float, poll_s: float = 1.0) -> str | None:
    """None as soon as something accepts a TCP connection at `endpoint`; after `timeout_s`
    of trying, why nothing did ("Connection refused", "timed out", ...)."""
    host, port = endpoint_host_port(endpoint)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(left, 1.0))):
                return None
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        time.sleep(min(poll_s, left))
