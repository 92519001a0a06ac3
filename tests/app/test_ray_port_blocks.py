"""Each local Ray node takes its workers' ports from a block no other live cluster on the machine holds.

With Ray's one default range for every node, the drivers of two clusters started side by side (one per pytest
worker) were handed the same port and the second one's Ray core failed to start its gRPC server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pollen.app.ray_cluster import PORT_BLOCK, PORT_BLOCKS, LocalRayCluster, claim_port_block


def test_two_claims_get_disjoint_blocks_below_the_ephemeral_ports_and_a_release_frees_one(tmp_path: Path) -> None:
    first, claim_a = claim_port_block(tmp_path)
    second, claim_b = claim_port_block(tmp_path)
    assert first != second and abs(first - second) >= PORT_BLOCK
    assert all(10_002 <= start and start + PORT_BLOCK <= 32_768 for start in (first, second))
    assert claim_a.read_text() == claim_b.read_text() == str(os.getpid())
    claim_a.unlink()
    assert claim_port_block(tmp_path)[0] == first  # released: the first free block again


def test_a_claim_whose_owner_is_gone_is_taken_over_and_a_live_ones_is_not(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / str(PORT_BLOCKS[0])).write_text(gone.stdout.strip())
    (tmp_path / str(PORT_BLOCKS[1])).write_text(str(os.getppid()))  # alive: the process that started pytest
    assert claim_port_block(tmp_path)[0] == PORT_BLOCKS[0]
    assert claim_port_block(tmp_path)[0] == PORT_BLOCKS[2]


def test_every_node_of_a_cluster_is_started_with_its_own_block_and_stop_releases_them(tmp_path: Path) -> None:
    commands: list[list[str]] = []
    cluster = LocalRayCluster(nodes=2)
    cluster._run = commands.append  # record the ray start commands instead of running them
    cluster._wait_for_nodes = lambda: None
    cluster.start()
    ranges = [
        tuple(int(arg.split("=")[1]) for arg in command if arg.startswith(("--min-worker-port", "--max-worker-port")))
        for command in commands
    ]
    assert len(ranges) == 2 and all(high - low == PORT_BLOCK - 1 for low, high in ranges)
    assert ranges[0][1] < ranges[1][0] or ranges[1][1] < ranges[0][0]
    held = list(cluster._claims)
    assert all(claim.exists() for claim in held)
    cluster.stop()
    assert not any(claim.exists() for claim in held)
