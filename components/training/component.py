"""training: finish the stream trainer's step and push the new weights to rollout."""

from kfp import dsl

from components.images import component_image


@dsl.component(base_image=component_image("training"), packages_to_install=[], install_kfp_package=False)
def training(config: str, plan: str, rollout: str, reward: str, judge: str) -> str:
    """Remaining gradients, the one optimizer step, checkpoint, weight push; returns the result JSON."""
    from rollpacker.stages.edge import train as stage

    return stage(config=config, plan=plan, rollout=rollout, reward=reward, judge=judge)
