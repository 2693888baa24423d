"""profiling: benchmark the rollout engine into a profile table (only when the plan asks)."""

from kfp import dsl

from components.images import component_image


@dsl.component(base_image=component_image("profiling"), packages_to_install=[], install_kfp_package=False)
def profiling(config: str, plan: str) -> str:
    """Profile prefill/decode latency and memory per TP size, batch and length; returns its URI as JSON."""
    from rollpacker.stages.edge import profile as stage

    return stage(config=config, plan=plan)
