"""The container image of every component, from one place.

Defaults are ``ghcr.io/rollpacker/<image>:0.1.0`` (built from ``images/<image>/`` by ``make images``);
``ROLLPACKER_IMAGE_<IMAGE>`` (e.g. ``ROLLPACKER_IMAGE_ROLLOUT=registry.local/rollout:dev``) overrides
one at compile time. The value is read when a component module is imported, so
``rollpacker.pipeline_compile.compile_pipelines`` re-imports the component modules on every call.

Profiling benchmarks the rollout engine, so it runs in the rollout image; the model preparation
(a warm-up: torch) runs in the training image.
"""

import os

REGISTRY = "ghcr.io/rollpacker"
VERSION = "0.1.0"
IMAGE_NAMES = ("controller", "rollout", "sandbox", "judge", "training")
DEFAULT_IMAGES: dict[str, str] = {name: f"{REGISTRY}/{name}:{VERSION}" for name in IMAGE_NAMES}

# component folder -> image it runs in
COMPONENT_IMAGES: dict[str, str] = {
    "controller": "controller",
    "profiling": "rollout",
    "rollout": "rollout",
    "sandbox_reward": "sandbox",
    "judge": "judge",
    "training": "training",
    "prepare_model": "training",  # a warm-up needs torch, which the controller image lacks
}


def env_var(name: str) -> str:
    """The environment variable that overrides image ``name``."""
    return f"ROLLPACKER_IMAGE_{name.upper()}"


def image(name: str) -> str:
    """The image ``name`` (one of IMAGE_NAMES): the env override if set and non-empty, else the default."""
    if name not in DEFAULT_IMAGES:
        raise KeyError(f"unknown image {name!r}; use one of {sorted(DEFAULT_IMAGES)}")
    return os.environ.get(env_var(name)) or DEFAULT_IMAGES[name]


def component_image(component: str) -> str:
    """The image the component folder ``component`` (e.g. ``profiling``) runs in."""
    if component not in COMPONENT_IMAGES:
        raise KeyError(f"unknown component {component!r}; use one of {sorted(COMPONENT_IMAGES)}")
    return image(COMPONENT_IMAGES[component])
