"""N RL steps of one arm chained: the ``prepare-model`` task (the arm's start model in the store),
then ``rl-step`` sub-pipelines, each after the previous one.

N is fixed at compile time (``rollpacker compile --steps N``); the controller keeps the state between
steps, so each sub-pipeline runs the arm's next step; in a step past ``config.steps`` only the plan
runs (``rl-step`` gates every other stage on ``plan.skip``).
"""

from components.prepare_model.component import prepare_model
from kfp import dsl

from pipelines.platform import on_cluster
from pipelines.rl_step import rl_step
from rollpacker.core.errors import ConfigError


def build_rl_experiment(num_steps: int):  # type: ignore[no-untyped-def]
    """The ``rl-experiment`` pipeline (parameters ``config``, ``arm``) of ``num_steps`` chained steps."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ConfigError(f"num_steps = {num_steps!r}: the experiment needs an integer >= 1 of RL steps")

    @dsl.pipeline(name="rl-experiment", description=f"{num_steps} RL steps of one arm, one after another.")
    def rl_experiment(config: str, arm: str):
        # the start model in the store before the first step: the plan stage trains nothing
        previous = on_cluster(
            prepare_model(config=config, arm=arm).set_caching_options(False), "prepare_model"
        )
        for i in range(num_steps):
            step = rl_step(config=config, arm=arm).set_caching_options(False)
            step.set_display_name(f"step-{i + 1}")
            step.after(previous)
            previous = step

    return rl_experiment
