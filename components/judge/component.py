"""judge: drain the step's LLM-judge rewards."""

from kfp import dsl

from components.images import component_image


@dsl.component(base_image=component_image("judge"), packages_to_install=[], install_kfp_package=False)
def judge(config: str, plan: str, rollout: str) -> str:
    """Drain the judge rewards of the step's responses."""
    from rollpacker.stages.edge import judge as stage

    return stage(config=config, plan=plan, rollout=rollout)
