"""The interface a multi-node run's workers listen on: on a host whose name does not
resolve to its address (Gloo would fall back to loopback, where no other node reaches it),
the one towards the rendezvous; nothing where the name resolves, on one machine, or where
the user named one. Real network namespaces (tests/hosts.py), each its own "machine"."""

from __future__ import annotations

import json
import sys

from hosts import hosts

# Run on a host: what the workers of a run whose rendezvous is at argv[1] would listen on.
ASK = """
import json, sys
from trainyard.runtime.network import listening_interface
print(json.dumps(listening_interface(sys.argv[1])))
"""


def _asked(host, endpoint: str, name: str | None = None, env: str = "") -> object:
    """listening_interface(endpoint) on `host`, its host name changed to `name` first."""
    rename = f"hostname {name} && " if name else ""
    command = ["sh", "-c", f'{rename}{env} exec "$0" -c "$1" "$2"', sys.executable, ASK, endpoint]
    done = host.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_workers_listen_towards_the_rendezvous_only_where_the_host_name_would_not_say():
    with hosts(2) as net:
        a, b = net
        endpoint = f"{b.address}:29400"
        # Its own name is in /etc/hosts with its address: Gloo finds it, nothing to set.
        assert _asked(a, endpoint) is None
        # A name nothing resolves (no line in /etc/hosts, no DNS): the interface to B.
        assert _asked(a, endpoint, name="nowhere") == ["eth0", a.address]
        # Debian's default: the name on 127.0.1.1, loopback.
        assert _asked(a, endpoint, name="localhost") == ["eth0", a.address]
        # Every node on this machine, or an interface the user chose: left alone.
        assert _asked(a, "127.0.0.1:29400", name="nowhere") is None
        assert _asked(a, endpoint, name="nowhere", env="GLOO_SOCKET_IFNAME=lo") is None
