"""Replies as soon as they are in: a deployed ServerApp asks the SuperLink for them within a second.

Flower's deployment ``Grid`` (``HttpGrid`` in 1.39 to 1.42) pushes a round's messages and then asks
for the replies every 3 seconds, so each exchange (identify, train, evaluate, every mid-round phase)
waits on average 1.5 s after its last reply arrived, and a round of three exchanges up to 9 s. In
simulation Flower's in-memory grid already asks every 0.1 s.

:class:`PromptGrid` wraps the deployment grid and collects replies with Flower's own public calls
(``push_messages`` then ``pull_messages``), asking again after 0.05 s, then twice as long each time
nothing new came, up to 1 s, and back to 0.05 s when something did. Its result is Flower's: the
replies that arrived before the timeout (none asked for when ``timeout`` is 0, all awaited when it
is ``None``), in arrival order. A message the SuperLink did not take (``push_messages`` answers
``None`` for it) has no reply to wait for; Flower's loop would wait the whole timeout for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

#: First pause between two requests for replies, in seconds; doubled while nothing new arrives.
FIRST_WAIT_S = 0.05
#: Longest pause between two requests for replies (Flower's own loop waits 3 s).
LONGEST_WAIT_S = 1.0


class PromptGrid(Grid):
    """``grid`` with a ``send_and_receive`` that asks for replies every 0.05-1 s instead of every 3 s.

    Everything else (run, nodes, pushing and pulling single messages) is ``grid``'s own.
    """

    def __init__(
        self,
        grid: Grid,
        *,
        first_wait: float = FIRST_WAIT_S,
        longest_wait: float = LONGEST_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not 0 < first_wait <= longest_wait:
            raise ValueError(
                f"PromptGrid waits first_wait={first_wait} then up to longest_wait={longest_wait} seconds; "
                "allowed: 0 < first_wait <= longest_wait"
            )
        self.grid = grid
        self.first_wait = first_wait
        self.longest_wait = longest_wait
        self._clock = clock
        self._sleep = sleep

    # ------------------------------------------------------------------ the wrapped grid's own
    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def __getattr__(self, name: str) -> Any:  # anything else a Flower version adds (``get_nodes``, ...)
        if name == "grid":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.grid, name)

    # ------------------------------------------------------------------ the prompt exchange
    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``, then collect their replies until all are in or ``timeout`` seconds passed."""
        waiting = {message_id for message_id in self.grid.push_messages(messages) if message_id is not None}
        del messages
        deadline = None if timeout is None else self._clock() + timeout
        replies: list[Message] = []
        pause = self.first_wait
        while waiting and (deadline is None or self._clock() < deadline):
            arrived = list(self.grid.pull_messages(waiting))
            replies.extend(arrived)
            waiting.difference_update(reply.metadata.reply_to_message_id for reply in arrived)
            if not waiting:
                break
            if arrived:  # more may be close behind
                pause = self.first_wait
            self._sleep(pause if deadline is None else min(pause, max(deadline - self._clock(), 0.0)))
            pause = min(2 * pause, self.longest_wait)
        return replies


def prompt(grid: Grid) -> Grid:
    """``grid`` wrapped in :class:`PromptGrid` when it is Flower's deployment grid, else ``grid`` itself.

    The simulation's in-memory grid asks every 0.1 s already, and test grids answer at once.
    """
    try:
        from flwr.superlink.grid import HttpGrid
    except ImportError:  # a Flower without it: its own loop stays
        return grid
    return PromptGrid(grid) if isinstance(grid, HttpGrid) else grid
