"""The committed chain's invariants, read back from the object store as a user would: what the
crash tests and the chaos suite check after a run with faults.

``chain_problems`` lists every broken invariant (empty: the chain holds):
- every step is committed exactly once (state chain -1..N-1), its commit record names the
  attempt whose groups log is kept;
- one optimizer update per committed step (policy version == step + 1: the update of a killed
  training stage was rolled back);
- exactly ``P0`` prompts trained per step, and the long-prompt queue follows from the
  predecessor state and the step's groups (FIFO: a long round takes the head, a short round
  appends what it deferred and never trains a queued prompt);
- the TP plan's history grows by exactly the step, and the plan is its replay;
- the exactly-once account (``core.accounting``): every prompt trained at most once per epoch,
  every deferred prompt trained, dropped by dynamic sampling or still waiting, and nothing queued
  that was not deferred or that was already consumed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rollpacker.core.accounting import StepPrompts, account_prompts


def read_chain(cfg_path: Path, arm: str, steps: int) -> tuple[Any, Any, Any, list[Any], list[dict[str, Any]]]:
    """The config, store, state store, states -1..steps-1 and groups logs of one arm."""
    from rollpacker.core.config import load_config
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    cfg = load_config(cfg_path)
    store = open_store(cfg.store)
    states = StateStore(store, cfg.experiment, arm)
    history = states.history()
    if history != list(range(-1, steps)):
        raise AssertionError(f"arm {arm}: committed steps {history}, expected -1..{steps - 1}")
    chain = [states.load(s) for s in range(-1, steps)]
    groups = [json.loads(states.get_blob(s, "groups.json")) for s in range(steps)]
    return cfg, store, states, chain, groups


def chain_problems(cfg_path: Path, steps: int, arm: str = "tail_batching") -> list[str]:
    """Every invariant of the module docstring that the arm's committed chain breaks."""
    from rollpacker.core.planner import replay

    try:
        cfg, _, states, chain, groups = read_chain(cfg_path, arm, steps)
    except AssertionError as e:
        return [str(e)]
    commits = [json.loads(states.get_blob(s, "commit.json")) for s in range(steps)]
    bad: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            bad.append(f"arm {arm}: {what}")

    p0 = cfg.rollout.prompts_per_step
    for s in range(steps):
        prev, cur, g = chain[s], chain[s + 1], groups[s]
        need(commits[s]["attempt"] == g["attempt"], f"step {s}: groups log of another attempt")
        need(
            cur.policy_version == prev.policy_version + 1 == s + 1,
            f"step {s}: policy version {cur.policy_version} (one update per committed step: {s + 1})",
        )
        need(len(g["trained"]) == p0, f"step {s}: {len(g['trained'])} prompts trained, not {p0}")
        if g["round_kind"] == "long":
            need(tuple(g["from_queue"]) == prev.long_queue[:p0], f"step {s}: long round not the queue's head")
            need(
                cur.long_queue == prev.long_queue[p0:] + tuple(g["deferred"]),
                f"step {s}: queue after a long round",
            )
        else:
            need(cur.long_queue == prev.long_queue + tuple(g["deferred"]), f"step {s}: queue after short")
            need(not set(g["trained"]) & set(prev.long_queue), f"step {s}: trained a queued prompt")
        need(cur.trained_prompts == prev.trained_prompts + p0, f"step {s}: trained_prompts count")
        need(
            cur.tp_plan.round_kinds == (*prev.tp_plan.round_kinds, g["round_kind"]),
            f"step {s}: TP plan round kinds",
        )
        need(len(cur.tp_plan.preemption_history) == s + 1, f"step {s}: TP plan preemption history")
        start = cur.tp_plan.initial_tp or cfg.planner.initial_tp
        need(cur.tp_plan.initial_tp == prev.tp_plan.initial_tp or s == 0, f"step {s}: initial TP changed")
        planned = replay(dataclasses.replace(cfg.planner, initial_tp=start), cur.tp_plan.history)
        need(
            (cur.tp_plan.short_tp, cur.tp_plan.long_tp) == (planned.tp_for("short"), planned.tp_for("long")),
            f"step {s}: the TP plan is not the replay of its history",
        )
    last = chain[-1]
    account = account_prompts(
        (StepPrompts(tuple(g["trained"]), tuple(g["deferred"]), tuple(g.get("dropped", ()))) for g in groups),
        queued=last.long_queue,
        buffered=(e.prompt_id for e in last.partial_cache),
        epochs=last.cursor_epoch + 1,
    )
    bad += [f"arm {arm}: {line}" for line in account.problems()]
    return bad


def check_chain(cfg_path: Path, steps: int, arm: str = "tail_batching"):  # type: ignore[no-untyped-def]
    """Assert the chain's invariants; returns the config, the store, the state store and the chain."""
    problems = chain_problems(cfg_path, steps, arm)
    assert not problems, "\n".join(problems)
    cfg, store, states, chain, _ = read_chain(cfg_path, arm, steps)
    return cfg, store, states, chain
