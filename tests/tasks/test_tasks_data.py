"""Synthetic math solutions and the seeded train/validation split."""

from __future__ import annotations

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample, split
from rollpacker.tasks import synthetic_math
from rollpacker.tasks.synthetic_math import SyntheticMathSpec

EXAMPLES = synthetic_math.generate(SyntheticMathSpec(num_examples=200), seed=0)


def test_synthetic_solutions_end_with_the_reference_answer() -> None:
    assert len(EXAMPLES) == 200
    for ex in EXAMPLES:
        sol = synthetic_math.reference_solution(ex)
        assert sol.splitlines()[-1] == f"Answer: {ex.reference}"
        assert len(sol.splitlines()) == synthetic_math.steps(ex) + 1
        assert ex.reward_kind is RewardKind.MATH
    steps = sorted(synthetic_math.steps(e) for e in EXAMPLES)
    assert steps[len(steps) // 2] <= 6 and steps[-1] >= 20  # heavy tail: median small, max much larger


@pytest.mark.parametrize("frac", [0.0, 0.1, 0.25, 0.5])
def test_split_disjoint_union_deterministic_fraction(frac) -> None:
    train, val = split(EXAMPLES, frac, seed=1)
    ids_t, ids_v = {e.example_id for e in train}, {e.example_id for e in val}
    assert not ids_t & ids_v
    assert ids_t | ids_v == {e.example_id for e in EXAMPLES}
    assert len(val) == round(200 * frac)
    assert split(EXAMPLES, frac, seed=1) == (train, val)
    assert [e.example_id for e in train] == [e.example_id for e in EXAMPLES if e.example_id in ids_t]


def test_split_depends_on_seed_and_rejects_bad_input() -> None:
    assert split(EXAMPLES, 0.25, seed=1)[1] != split(EXAMPLES, 0.25, seed=2)[1]
    with pytest.raises(ConfigError, match="val_fraction"):
        split(EXAMPLES, 1.0, seed=0)
    dup = [TaskExample("a", "p", RewardKind.JUDGE), TaskExample("a", "q", RewardKind.JUDGE)]
    with pytest.raises(ConfigError, match="more than once"):
        split(dup, 0.5, seed=0)


def test_long_tail_shape_of_the_embedded_default() -> None:
    """configs/experiment.yaml's ``task.shape``: P75 an order of magnitude below the longest
    solution, and the longest near 1.5k tokens (one byte-level token per character)."""
    from rollpacker.core.config import load_config

    shape = dict(load_config("configs/experiment.yaml").task.shape.items())
    exs = synthetic_math.generate(SyntheticMathSpec(num_examples=2000, **shape), seed=0)
    lengths = sorted(len(synthetic_math.reference_solution(e)) + 1 for e in exs)
    p75, longest = lengths[int(0.75 * (len(lengths) - 1))], lengths[-1]
    assert 1000 <= longest <= 2000 and longest >= 8 * p75
    hard = [e for e in exs if synthetic_math.steps(e) >= shape["hard_min_steps"]]
    assert 0.10 <= len(hard) / len(exs) <= 0.20  # the hard fraction, drawn per prompt
    # the default spec stays short (the tests' tiny warm-up and short max_tokens rely on it)
    short = synthetic_math.generate(SyntheticMathSpec(num_examples=2000), seed=0)
    assert max(len(synthetic_math.reference_solution(e)) for e in short) < 1000


def test_task_shape_is_checked_and_reaches_the_loaders() -> None:
    from rollpacker.core.config import config_from_text
    from rollpacker.tasks.registry import load_task

    with pytest.raises(ConfigError, match=r"task\.shape\.hard_fraction"):
        config_from_text("task: {shape: {hard_fraction: 1.5}}")
    with pytest.raises(ConfigError, match=r"task\.shape\.hard_min_steps"):
        config_from_text("task: {shape: {max_steps: 20, hard_min_steps: 30}}")
    cfg = config_from_text(
        "task: {name: mixed, shape: {hard_fraction: 1.0, hard_min_steps: 40, max_steps: 60}}"
    )
    exs = load_task("mixed", seed=0, num_examples=30, shape=cfg.task.shape.items())
    maths = [e for e in exs if e.metadata.get("task") in ("synthetic_math", "synthetic_judge")]
    assert len(maths) == 20 and all(40 <= int(e.metadata["steps"]) <= 60 for e in maths)
    assert load_task("mixed", seed=0, num_examples=30) != exs


def test_verbose_solutions_carry_the_step_count_and_end_like_short_ones() -> None:
    """Verbose lines repeat k/n (a tiny model stops at the right line) and end in ``=y`` like the
    short ones, so the judge's tail window reads both alike; replaying them gives the answer."""
    spec = SyntheticMathSpec(num_examples=50, verbose=True)
    for ex, short in zip(
        synthetic_math.generate(spec, seed=5),
        synthetic_math.generate(SyntheticMathSpec(num_examples=50), seed=5),
        strict=True,
    ):
        n, sol = synthetic_math.steps(ex), synthetic_math.reference_solution(ex)
        lines = sol.splitlines()
        assert len(lines) == n + 1 and lines[-1] == f"Answer: {ex.reference}"
        assert all(line.startswith(f"{k}/{n}: ") for k, line in enumerate(lines[:-1], start=1))
        assert sol[-12:] == synthetic_math.reference_solution(short)[-12:]
        x = int(ex.metadata["start"])
        for line in lines[:-1]:  # "k/n: x+a=s, mod 10=y"
            lhs, y = line.rsplit("=", 1)
            a = int(line.split("+")[1].split("=")[0])
            assert int(y) == (x + a) % 10 and lhs.split(": ")[1].startswith(f"{x}+")
            x = int(y)
        assert x == int(ex.reference)


def test_model_identity_names_the_start_model_without_building_it(tmp_path) -> None:
    """The start checkpoint's store key carries it: a changed warm-up or task shape (a different
    model) must get a different key, the same config the same one."""
    from rollpacker.core.config import config_from_text
    from rollpacker.tasks.models import model_identity

    base = "task: {name: mixed}\nmodel: {warmup_steps: 200}\n"
    ident = model_identity(config_from_text(base))
    assert ident == model_identity(config_from_text(base)) and ident.startswith("warm-tiny-")
    assert model_identity(config_from_text(base.replace("200", "600"))) != ident
    assert model_identity(config_from_text(base.replace("mixed}", "mixed, shape: {verbose: true}}"))) != ident
    assert model_identity(config_from_text("model: {warmup_steps: 0}")).startswith("tiny-")
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    one = model_identity(config_from_text(f"model: {{model_dir: '{d}'}}"))
    (d / "model.safetensors").write_bytes(b"x")
    assert model_identity(config_from_text(f"model: {{model_dir: '{d}'}}")) != one


def test_a_sloppy_teachers_solution_slips_exactly_once_and_the_answer_is_wrong() -> None:
    """``slipped_solution``: one line's sum is off by 1-9 (which line and by how much vary), every
    other line is right given the line before, and so the final answer is never the reference."""
    import random
    import re

    rng = random.Random(0)
    slipped_lines: set[int] = set()
    for verbose in (False, True):
        for ex in synthetic_math.generate(SyntheticMathSpec(num_examples=200, verbose=verbose), seed=3):
            m = ex.metadata
            add, n = int(m["add"]), int(m["steps"])
            text = synthetic_math.slipped_solution(ex, rng)
            *lines, last = text.split("\n")
            assert len(lines) == n
            x, wrong = int(m["start"]), []
            for k, line in enumerate(lines, 1):
                y = int(re.search(r"=(\d)$", line).group(1))  # type: ignore[union-attr]
                if y != (x + add) % 10:
                    wrong.append(k)
                x = y
            assert len(wrong) == 1, (text, wrong)
            slipped_lines.add(wrong[0])
            assert last == f"Answer: {x}" and x != int(ex.reference)
    assert len(slipped_lines) > 3  # the slip lands on different lines


def test_the_warm_up_slip_rate_is_checked_and_names_its_own_model() -> None:
    from rollpacker.core.config import config_from_text
    from rollpacker.tasks.models import model_identity
    from rollpacker.tasks.warmup import WarmupSpec

    base = "model: {warmup_steps: 200}\n"
    clean = model_identity(config_from_text(base))
    sloppy = model_identity(config_from_text("model: {warmup_steps: 200, warmup_slip_rate: 0.5}\n"))
    assert sloppy != clean  # never served from the clean warm-up's cache
    assert WarmupSpec(slip_rate=0.0).key() == WarmupSpec().key()
    for bad in ("1.0", "-0.1", "true", "'half'"):
        with pytest.raises(ConfigError, match=r"model\.warmup_slip_rate"):
            config_from_text(f"model: {{warmup_slip_rate: {bad}}}\n")
