"""The control channel and the heartbeats on a real coordination service.

A subprocess starts JAX's distributed runtime alone (one process: it hosts the service), then
plays rank 0 and a follower on that one store: messages arrive once and in order, read ones are
deleted, a waiting follower times out instead of hanging, and a follower whose heartbeat stops
is declared lost within the limit, naming its rank.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import jax
    from jaxserve.config import EngineConfig
    from jaxserve.distributed import channel as channel_module
    from jaxserve.distributed.channel import ControlChannel
    from jaxserve.distributed.liveness import Heartbeat, NodeMonitor
    from jaxserve.distributed.messages import Collect, Shutdown
    from jaxserve.distributed.runtime import coordination_client, start_distributed_runtime
    from jaxserve.exceptions import NodeLostError

    def time_to_loss(monitor, limit_s=5.0):
        # (the monitor's NodeLostError text, seconds until it came), or (None, limit_s)
        t = time.monotonic()
        try:
            while time.monotonic() - t < limit_s:
                monitor.check(force=True)
                time.sleep(0.05)
        except NodeLostError as exc:
            return str(exc), time.monotonic() - t
        return None, limit_s

    port = int(sys.argv[1])
    start_distributed_runtime(EngineConfig(nnodes=1, master_addr="127.0.0.1", master_port=port))
    start_distributed_runtime(EngineConfig(nnodes=1, master_addr="127.0.0.1", master_port=port))  # idempotent
    client = coordination_client()
    found = {"devices": jax.device_count()}

    leader, follower = ControlChannel(client, 0, 2), ControlChannel(client, 1, 2)
    t = time.monotonic()
    found["empty_receive"] = follower.receive(0.2)
    found["empty_wait_s"] = time.monotonic() - t
    count = 2 * channel_module.PRUNE_EVERY + 3
    received = []
    for i in range(count):
        leader.publish([Collect()] * (i % 3) + [Shutdown()])
        received.append(len(follower.receive(5.0)))
    found["received"] = received
    found["expected"] = [i % 3 + 1 for i in range(count)]
    left = client.key_value_dir_get_bytes(channel_module.NAMESPACE + "/calls/")
    found["messages_left"] = len(left)

    beat = Heartbeat(client, 1, interval_s=0.05).start()
    monitor = NodeMonitor(client, 2, timeout_s=0.5)
    for _ in range(20):  # 1 s of checks while rank 1 beats: no loss
        monitor.check(force=True)
        time.sleep(0.05)
    beat.stop()
    found["lost"], found["lost_after_s"] = time_to_loss(monitor)

    # The step-progress watchdog: a follower that beats but stops applying messages is lost.
    applied = [0]
    beat = Heartbeat(client, 1, interval_s=0.05, progress=lambda: applied[0]).start()
    monitor = NodeMonitor(client, 2, timeout_s=0.5)
    for i in range(20):  # 1 s of messages, each applied: no loss
        monitor.note_published()
        time.sleep(0.05)
        applied[0] += 1
        time.sleep(0.05)
        monitor.check(force=True)
    monitor.note_published()  # never applied, while the heartbeat goes on
    found["stuck"], found["stuck_after_s"] = time_to_loss(monitor)
    beat.stop()
    print("RESULT " + json.dumps(found))
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_channel_and_heartbeats_on_a_real_coordination_service():
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], capture_output=True, text=True,
                         timeout=120)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-3000:]
    found = json.loads(line[len("RESULT "):])
    assert found["devices"] >= 1
    assert found["empty_receive"] is None and found["empty_wait_s"] < 2
    assert found["received"] == found["expected"]
    assert found["messages_left"] < 70  # pruned: only those since the last prune remain
    assert found["lost"] is not None and "node 1 of 2" in found["lost"]
    assert 0.4 < found["lost_after_s"] < 2.0
    assert found["stuck"] is not None and "stuck outside a collective" in found["stuck"], found["stuck"]
    assert "node 1 of 2" in found["stuck"] and "at message 20 of 21" in found["stuck"]
    assert 0.4 < found["stuck_after_s"] < 2.0
