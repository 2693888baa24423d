"""prepare-model: the arm's start model in the store before its first step (the model preparation,
``rollpacker.tasks.prepare``). It runs in the training image, which has torch for a warm-up; the
plan stage then reads the model from the store and trains nothing."""

from kfp import dsl

from components.images import component_image


@dsl.component(base_image=component_image("prepare_model"), packages_to_install=[], install_kfp_package=False)
def prepare_model(config: str, arm: str) -> str:
    """The warm-up (or ``model.model_dir``) uploaded to the store unless it is there; its URI ("" when
    the arm already has a committed state)."""
    from rollpacker.tasks.prepare import prepare as stage

    return stage(config=config, arm=arm)
