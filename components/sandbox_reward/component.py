"""sandbox-reward: drain the step's rule and code (sandbox) rewards."""

from kfp import dsl

from components.images import component_image


@dsl.component(
    base_image=component_image("sandbox_reward"), packages_to_install=[], install_kfp_package=False
)
def sandbox_reward(config: str, plan: str, rollout: str) -> str:
    """Drain the rule/code rewards, update the timeout anchors, write the reward shard."""
    from rollpacker.stages.edge import reward as stage

    return stage(config=config, plan=plan, rollout=rollout)
