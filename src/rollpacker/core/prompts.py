"""Where prompts come from between steps: the dataset cursor and the long-prompt queue.

Invariants:
- the cursor hands out each prompt of an epoch exactly once, in a seeded order that depends only
  on (seed, epoch, window); its position is plain data (``CursorState``) so a restart resumes
  exactly;
- any ``window`` consecutive prompts it hands out are distinct, across epoch boundaries too (a
  round draws at most ``window`` prompts at once, and a prompt twice in one round is invalid);
- the long-prompt queue is FIFO: prompts leave in the order they entered;
- neither object changes on ``peek``; state moves only on ``advance`` / ``pop`` / ``push``, which the
  policy calls when a round is committed, so a round that dies before commit changes nothing.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rollpacker.core.errors import PolicyError
from rollpacker.core.types import Prompt


@dataclass(frozen=True)
class CursorState:
    seed: int
    epoch: int
    position: int


class PromptCursor:
    """A seeded, resumable walk over a fixed list of prompts.

    ``shuffle=False`` keeps the file order (replay traces); ``epochs=None`` cycles forever, a
    number stops with a ``PolicyError`` once that many epochs are used up.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = None,
        state: CursorState | None = None,
        window: int = 1,
    ) -> None:
        if not prompts:
            raise PolicyError("the prompt set is empty: give a dataset or trace with >= 1 prompt")
        ids = [p.prompt_id for p in prompts]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise PolicyError(f"prompt id {dup!r} appears more than once; prompt ids must be unique")
        if window < 1:
            raise PolicyError(f"window = {window}: must be >= 1")
        if shuffle and window > 1 and len(prompts) < 2 * window:
            raise PolicyError(
                f"{len(prompts)} prompts cannot fill rounds of up to {window} distinct prompts across "
                f"epoch boundaries (need >= {2 * window}): add prompts or draw fewer per step "
                "(rollout.prompts_per_step, rollout.eta_p)"
            )
        if not shuffle and window > len(prompts):
            raise PolicyError(
                f"{len(prompts)} prompts cannot fill a round of {window} distinct prompts: add prompts "
                "or draw fewer per step"
            )
        self._prompts = tuple(prompts)
        self._shuffle = shuffle
        self._epochs = epochs
        self._window = window
        self._orders: dict[int, list[int]] = {}
        st = state or CursorState(seed=seed, epoch=0, position=0)
        self._seed, self._epoch, self._pos = st.seed, st.epoch, st.position
        self._order = self._order_for(self._epoch)

    def _raw_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self._shuffle:
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order

    def _order_for(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order: its seeded shuffle, with any of the previous epoch's last
        ``window`` prompts that fell into its first ``window`` places moved just past them."""
        if epoch in self._orders:
            return self._orders[epoch]
        w = self._window
        if not self._shuffle or w == 1:
            order = self._raw_order(epoch)
        else:
            # Built forward from epoch 0 (each order depends on the one before); a few shuffles
            # of the prompt ids per epoch, once per cursor.
            start = max((e for e in self._orders if e < epoch), default=-1)
            order = self._orders[start] if start >= 0 else []
            for e in range(start + 1, epoch + 1):
                order = self._spread(self._raw_order(e), set(order[-w:]) if e > 0 else set())
            self._orders.clear()
        self._orders[epoch] = order
        return order

    def _spread(self, raw: list[int], prev_tail: set[int]) -> list[int]:
        w = self._window
        head, rest = raw[:w], raw[w:]
        clash = [i for i in head if i in prev_tail]
        if not clash:
            return raw
        fill: list[int] = []
        later: list[int] = []
        for i in rest:
            if len(fill) < len(clash) and i not in prev_tail:
                fill.append(i)
            else:
                later.append(i)
        return [i for i in head if i not in prev_tail] + fill + clash + later

    @property
    def state(self) -> CursorState:
        return CursorState(self._seed, self._epoch, self._pos)

    def remaining(self) -> int | None:
        """Prompts left before the epoch limit (None: unlimited)."""
        if self._epochs is None:
            return None
        return max(0, (self._epochs - self._epoch) * len(self._prompts) - self._pos)

    def peek(self, n: int) -> tuple[Prompt, ...]:
        """The next ``n`` prompts, without moving the cursor."""
        out: list[Prompt] = []
        epoch, pos, order = self._epoch, self._pos, self._order
        while len(out) < n:
            if pos == len(order):
                epoch, pos = epoch + 1, 0
                order = self._order_for(epoch)
            if self._epochs is not None and epoch >= self._epochs:
                raise PolicyError(
                    f"the prompt set is used up ({len(self._prompts)} prompts x {self._epochs} "
                    f"epoch(s)) and {n - len(out)} more are needed: add prompts, allow more epochs, "
                    "or run fewer steps"
                )
            out.append(self._prompts[order[pos]])
            pos += 1
        return tuple(out)

    def draw_excluding(
        self, n: int, skip: set[str], held_in: str = "the rollout buffer"
    ) -> tuple[tuple[Prompt, ...], list[int]]:
        """The next ``n`` distinct prompts that are not in ``skip`` (prompts a policy holds: on a
        small dataset one comes round again in the next epoch; that draw is skipped, i.e.
        consumed), and for each its position + 1 (how far ``advance`` moves if a round uses the
        prompts up to it). Does not move the cursor."""
        if n == 0:
            return (), []
        k = n
        while True:
            picked: list[Prompt] = []
            ends: list[int] = []
            seen = set(skip)
            for pos, p in enumerate(self.peek(k)):
                if p.prompt_id in seen:
                    continue
                seen.add(p.prompt_id)
                picked.append(p)
                ends.append(pos + 1)
                if len(picked) == n:
                    return tuple(picked), ends
            if k > 4 * n + 2 * len(skip):
                raise PolicyError(
                    f"cannot draw {n} prompts that are not in {held_in} ({len(skip)} are): the "
                    "dataset is too small for this step size"
                )
            k += n

    def advance(self, n: int) -> None:
        """Consume ``n`` prompts (after a round that used them is committed)."""
        self.peek(n)  # raises if they are not there
        for _ in range(n):
            if self._pos == len(self._order):
                self._epoch, self._pos = self._epoch + 1, 0
                self._order = self._order_for(self._epoch)
            self._pos += 1


class LongPromptQueue:
    """FIFO of prompts deferred by short rounds, waiting for a long round."""

    def __init__(self, prompts: Iterable[Prompt] = ()) -> None:
        self._q: deque[Prompt] = deque()
        self.push(prompts)

    def __len__(self) -> int:
        return len(self._q)

    def push(self, prompts: Iterable[Prompt]) -> None:
        for p in prompts:
            if any(q.prompt_id == p.prompt_id for q in self._q):
                raise PolicyError(
                    f"prompt {p.prompt_id!r} is already in the long-prompt queue; a prompt may wait "
                    "there only once"
                )
            self._q.append(p)

    def peek(self, n: int) -> tuple[Prompt, ...]:
        if n > len(self._q):
            raise PolicyError(f"long-prompt queue holds {len(self._q)} prompts, {n} were asked for")
        return tuple(self._q[i] for i in range(n))

    def pop(self, n: int) -> tuple[Prompt, ...]:
        out = self.peek(n)
        for _ in range(n):
            self._q.popleft()
        return out

    def snapshot(self) -> tuple[Prompt, ...]:
        return tuple(self._q)
