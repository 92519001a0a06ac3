"""Many SuperNodes over TLS with node authentication; a third of them killed and restarted mid-run.

Six ``flower-supernode`` processes (each with its own key, registered with the SuperLink, and its own
node-local ``state-dir``) run FedBNLACA (top-k both ways: every client keeps a model copy, the last
increment, its last upload and an error-feedback residual between rounds). As soon as two of them
have sent their round-1 reply they are SIGKILLed (the whole process tree: a machine losing power) and
started again with the same key and node-config, as a supervisor would (``deploy/systemd``): the
SuperLink refuses the new process until the dead one's heartbeat window ends (up to a minute in Flower
1.39), and answers the messages it could not deliver meanwhile with its own error reply, which is that
node's one failure of the round. The run must complete; the restarted nodes train again from the state
they find in ``state-dir`` (no client asks for a resync: without its state a restarted client of this
method replies ``lazy-resync`` and gets the full model again), and the last round hears from every client.
The downlink's bytes are checked on the way: the full model to every node in round 1, top-k increments
against each node's copy in the last.

The nodes are killed between their messages, so no round waits for a reply that will never come
(``round-timeout``); ``benchmarks/deploy/bench_many_supernodes.py`` kills them in the middle of a round.
Six SuperNodes keep the test short on CI's two cores (each message starts a fresh ``flwr-clientapp``
process; nine took about five minutes of CI); the benchmark goes to 40.
"""

from __future__ import annotations

import re
import shutil
import sys
import time

import pytest

from pollen.compression import make_codec
from pollen.testing import local_federation as lf
from pollen.testing.secure_federation import SecureFederation, rounds_written

pytestmark = [
    pytest.mark.slow,
    # with the other deployment tests, on one worker: six SuperNodes starting ClientApps beside another
    # federation could leave a ClientApp unstarted for Flower's 30 s, and Flower then starts it again
    pytest.mark.xdist_group("deploy-e2e"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process helpers read /proc"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="make_certs.sh needs openssl"),
]

NUM_NODES = 6
CNN_TRAINABLE = 29_034  # the CNN's trainable values
KILLED = range(NUM_NODES // 3)
ROUNDS = 3
KILL_AFTER_ROUND = 1
RUN_CONFIG = {
    "strategy": "fedbnlaca",
    "compressor": "topk",
    "topk-ratio": 0.125,
    "compressor-down": "topk",
    "topk-ratio-down": 0.125,
    "num-server-rounds": ROUNDS,
    "local-steps": 2,
    "model": "cnn",
    "partitioner": "iid",
    "fraction-train": 1.0,
    "min-train-nodes": NUM_NODES,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "eval-every": ROUNDS,
    "test-examples": 1000,
    "plots": False,
    "round-timeout": 600.0,  # never reached: no message is lost
    "node-wait-seconds": 300.0,
    "run-name": "many",
}


def rejected_by_round(log: str) -> dict[int, list[tuple[str, str]]]:
    """``{round: [(client, reason), ...]}`` from the ServerApp's "rejected reply from ..." log lines."""
    out: dict[int, list[tuple[str, str]]] = {}
    for part in re.split(r"\[ROUND (?=\d+/)", log)[1:]:
        server_round = int(part.split("/", 1)[0])
        out[server_round] = re.findall(r"rejected reply from (\S+) \(node \d+\): ([^\n]*)", part)
    return out


def check_lazy_downlink(first: dict, last: dict) -> None:
    """Round 1 sends every node the full model; the last round top-k 1/8 increments against each node's copy
    (the restarted nodes' copies included: they came back from ``state-dir``)."""
    events, down = first["method.lazy_events"], first["downlink_by_record"]
    assert events["down-full"] == NUM_NODES and "pollen.down" not in down, first
    events, down = last["method.lazy_events"], last["downlink_by_record"]
    assert events["down-send"] == NUM_NODES and "arrays" not in down, last
    payload = make_codec("topk", topk_ratio=0.125).payload_bytes(CNN_TRAINABLE)
    per_node_down = down["pollen.down"] / NUM_NODES
    assert payload <= per_node_down < payload + 512, last  # the codec's bytes and the record's framing
    assert per_node_down < 0.3 * first["downlink_by_record"]["arrays"] / NUM_NODES, (first, last)


def test_a_third_of_the_supernodes_killed_and_restarted_rejoin_with_their_state(tmp_path):
    procs = lf.Processes(tmp_path / "logs")
    try:
        with lf.dump_logs_on_error(procs):
            fed = SecureFederation(tmp_path, procs, NUM_NODES)
            fed.register_all()
            for index in range(NUM_NODES):
                fed.start_node(index)
            fed.wait_online(NUM_NODES)

            results = tmp_path / "results"
            run = fed.start_run("flwr-run", dict(RUN_CONFIG, **{"results-dir": str(results)}))
            for index in KILLED:
                lf.wait_until(
                    lambda i=index: fed.replies_sent(i) >= KILL_AFTER_ROUND or run.poll() is not None,
                    600,
                    f"node {index}'s round-{KILL_AFTER_ROUND} reply",
                )
                assert run.poll() is None, run.output()
                fed.kill_node(index)
                assert any(fed.state_dir(index).rglob("*.npz")), f"node {index} kept no client state in its state-dir"
            for index in KILLED:  # refused until the SuperLink's heartbeat window for the dead process ends
                fed.restart_node(index)
            assert rounds_written(results / "many") < ROUNDS, "the nodes were killed too late"

            deadline = time.monotonic() + 900
            while run.poll() is None and time.monotonic() < deadline:
                procs.procs[0].remember_tree()
                time.sleep(1)
            assert run.poll() == 0, run.output()
            assert "[pollen] done" in run.output(), run.output()

            rows = {row["round"]: row for row in lf.load_metrics(results, "many")["rows"]}
            assert sorted(rows) == list(range(ROUNDS + 1))
            resyncs = {r: rows[r].get("method.lazy_events", {}).get("resync", 0) for r in range(1, ROUNDS + 1)}
            assert all(count == 0 for count in resyncs.values()), f"clients lost their state: {resyncs}"
            killed_clients = {f"partition-{index}" for index in KILLED}
            for r, rejected in rejected_by_round(run.output()).items():  # only the killed nodes', once each
                clients = [client for client, _ in rejected]
                assert len(clients) == len(set(clients)) == rows[r]["failures"], rejected
                assert set(clients) <= killed_clients, rejected
            last = rows[ROUNDS]
            assert last["replies"] == NUM_NODES and last["failures"] == 0, last
            check_lazy_downlink(rows[1], last)
            for index in KILLED:  # the restarted process answered train messages from the state it found
                assert fed.trained_messages(index, since_start=1) >= 1, f"restarted node {index} never trained"
            assert fed.superlink.poll() is None, "the SuperLink must outlive its SuperNodes' crashes"
    finally:
        procs.stop_all()
        left = procs.leftovers()
        assert not left, f"processes still alive after teardown: {left}"
