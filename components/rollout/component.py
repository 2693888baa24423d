"""rollout: run the arm's rollout policy on the RolloutService for the planned step."""

from kfp import dsl

from components.images import component_image


@dsl.component(base_image=component_image("rollout"), packages_to_install=[], install_kfp_package=False)
def rollout(config: str, plan: str) -> str:
    """Generate the step's groups (handing finished ones to rewards and the trainer as they finish)."""
    from rollpacker.stages.edge import rollout as stage

    return stage(config=config, plan=plan)
