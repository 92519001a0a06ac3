"""PromptGrid: a deployed ServerApp's replies collected within a second instead of every 3 s.

A scripted grid plays the SuperLink: each pushed message's reply becomes available at a set time on a
fake clock, and every ``pull_messages`` request and pause is recorded. Checked: every reply comes
back, the pauses grow 0.05 -> 1 s while nothing arrives and start again at 0.05 s when something
does, the timeout holds (last pause cut to it; 0 asks nothing), a message the SuperLink refused is
not waited for, and only Flower's deployment grid is wrapped.
"""

from __future__ import annotations

import pytest
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.superlink.grid import HttpGrid, InMemoryGrid

from pollen.app.prompt_grid import FIRST_WAIT_S, LONGEST_WAIT_S, PromptGrid, prompt
from pollen.testing.fakes import FakeGrid


class ScriptedSuperLink(Grid):
    """Replies become available at ``arrive_at[node]`` on a fake clock; ``refuse`` nodes get no id."""

    def __init__(self, arrive_at: dict[int, float], refuse: frozenset[int] = frozenset()) -> None:
        self.arrive_at = arrive_at
        self.refuse = refuse
        self.now = 0.0
        self.pauses: list[float] = []
        self.pull_times: list[float] = []
        self._pending: dict[str, tuple[float, Message]] = {}
        self._run = "the run record"

    # the fake clock
    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds

    # Flower's Grid
    def push_messages(self, messages):  # noqa: ANN001, ANN201
        ids = []
        for index, message in enumerate(messages):
            node = message.metadata.dst_node_id
            if node in self.refuse:
                ids.append(None)
                continue
            message.metadata.__dict__["_message_id"] = f"m{index}"
            self._pending[f"m{index}"] = (self.arrive_at[node], Message(RecordDict(), reply_to=message))
            ids.append(f"m{index}")
        return ids

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        self.pull_times.append(self.now)
        ready = [mid for mid in sorted(message_ids) if mid in self._pending and self._pending[mid][0] <= self.now]
        return [self._pending.pop(mid)[1] for mid in ready]

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        raise AssertionError("PromptGrid must not fall back to the wrapped grid's 3 s loop")

    def get_node_ids(self):  # noqa: ANN201
        return sorted(self.arrive_at)

    def set_run(self, run) -> None:  # noqa: ANN001
        self._run = run

    @property
    def run(self):  # noqa: ANN201
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001, ANN201
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)


def messages_to(*nodes: int) -> list[Message]:
    return [Message(RecordDict(), dst_node_id=node, message_type="train") for node in nodes]


def prompt_grid(link: ScriptedSuperLink) -> PromptGrid:
    return PromptGrid(link, clock=link.clock, sleep=link.sleep)


def test_every_reply_comes_back_and_the_pauses_grow_until_something_arrives():
    link = ScriptedSuperLink({1: 0.0, 2: 2.0, 3: 2.0})
    replies = prompt_grid(link).send_and_receive(messages_to(1, 2, 3), timeout=60)
    assert sorted(reply.metadata.src_node_id for reply in replies) == [1, 2, 3]
    # node 1 at once, then nothing until t=2: the pause starts again after an arrival and doubles to 1 s
    assert link.pauses[:6] == pytest.approx([FIRST_WAIT_S, 0.1, 0.2, 0.4, 0.8, LONGEST_WAIT_S])
    assert max(link.pauses) == LONGEST_WAIT_S
    assert link.pull_times[-1] == pytest.approx(2.55)  # the first request after t=2: within 1 s, not Flower's 3 s
    assert link.pull_times[-1] - 2.0 <= LONGEST_WAIT_S


def test_an_arrival_starts_the_pauses_again_from_the_shortest():
    link = ScriptedSuperLink({1: 0.1, 2: 5.0})
    prompt_grid(link).send_and_receive(messages_to(1, 2), timeout=60)
    # t=0, 0.05: nothing; t=0.15: node 1's reply, so 0.05 again, then doubling towards node 2's
    assert link.pauses[:5] == pytest.approx([FIRST_WAIT_S, 0.1, FIRST_WAIT_S, 0.1, 0.2])


def test_the_timeout_holds_with_the_replies_in_by_then():
    link = ScriptedSuperLink({1: 0.0, 2: 100.0})
    replies = prompt_grid(link).send_and_receive(messages_to(1, 2), timeout=3.0)
    assert [reply.metadata.src_node_id for reply in replies] == [1]
    assert link.now == pytest.approx(3.0)  # the last pause is cut to the deadline
    assert sum(link.pauses) == pytest.approx(3.0)


def test_a_zero_timeout_asks_for_nothing():
    link = ScriptedSuperLink({1: 0.0})
    assert list(prompt_grid(link).send_and_receive(messages_to(1), timeout=0.0)) == []
    assert link.pull_times == []


def test_no_timeout_waits_for_every_reply():
    link = ScriptedSuperLink({1: 0.0, 2: 250.0})
    replies = prompt_grid(link).send_and_receive(messages_to(1, 2), timeout=None)
    assert sorted(reply.metadata.src_node_id for reply in replies) == [1, 2]
    assert 250.0 <= link.now <= 250.0 + LONGEST_WAIT_S


def test_a_message_the_superlink_refused_is_not_waited_for():
    link = ScriptedSuperLink({1: 0.0, 2: 0.0}, refuse=frozenset({2}))
    replies = prompt_grid(link).send_and_receive(messages_to(1, 2), timeout=60)
    assert [reply.metadata.src_node_id for reply in replies] == [1]
    assert link.now == 0.0 and link.pauses == []


def test_everything_else_is_the_wrapped_grids():
    link = ScriptedSuperLink({4: 0.0, 7: 0.0})
    grid = prompt_grid(link)
    assert list(grid.get_node_ids()) == [4, 7]
    assert grid.run == "the run record"
    grid.set_run("another run")
    assert link.run == "another run"
    assert grid.arrive_at is link.arrive_at  # attributes the wrapper does not name
    message = grid.create_message(RecordDict(), "train", 4, "g")
    assert message.metadata.dst_node_id == 4


@pytest.mark.parametrize(("first", "longest"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_bad_waits_are_refused_with_what_is_allowed(first, longest):
    with pytest.raises(ValueError, match="allowed: 0 < first_wait <= longest_wait"):
        PromptGrid(ScriptedSuperLink({}), first_wait=first, longest_wait=longest)


def test_only_flowers_deployment_grid_is_wrapped():
    deployed = HttpGrid.__new__(HttpGrid)  # no SuperLink needed to know its type
    wrapped = prompt(deployed)
    assert isinstance(wrapped, PromptGrid) and wrapped.grid is deployed
    simulated = InMemoryGrid.__new__(InMemoryGrid)  # asks every 0.1 s already
    assert prompt(simulated) is simulated
    fake = FakeGrid([1], lambda message: None)
    assert prompt(fake) is fake
