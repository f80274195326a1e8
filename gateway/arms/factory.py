"""Build a deployment from settings: one local arm from the flags, or the YAML `arms:`.

Local arms of the same deployment share one copy of the model weights (loaded once, on the
first arm's start); each has its own engine thread, KV cache and sampler. They then share
the device too: see docs/ab-testing.md for when a live split is a fair comparison.
"""

from __future__ import annotations

from backends.upstream import UpstreamConfig
from gateway.arms.arm import Arm
from gateway.arms.deployment import Deployment
from gateway.arms.engine_factory import (
    SharedWeights,
    check_backend_settings,
    load_backend,
    scheduler_config,
    serving_options,
)
from gateway.arms.local import LocalArm
from gateway.arms.upstream import UpstreamArm
from gateway.settings.arms import ArmSettings
from gateway.settings.load import Settings


def arm_settings(settings: Settings, arm: ArmSettings) -> Settings:
    """The top-level settings with a local arm's own knobs laid over them (both validated)."""
    update = arm.engine_overrides()
    options = update.pop("scheduler_options", {})
    update["scheduler_options"] = {**settings.scheduler_options, **options}
    return settings.model_copy(update=update)


def local_arm(settings: Settings, name: str, weight: float, weights: SharedWeights) -> LocalArm:
    check_backend_settings(settings)  # at start-up, before any weights load
    arm = LocalArm(
        name,
        lambda: load_backend(settings, weights),
        scheduler=settings.scheduler,
        config=scheduler_config(settings),
        policy_options=settings.scheduler_options,
        options=serving_options(settings),
    )
    arm.weight = weight
    return arm


def upstream_arm(arm: ArmSettings) -> UpstreamArm:
    assert arm.upstream is not None
    # NOTE: UpstreamSettings mirrors UpstreamConfig field for field (validated YAML -> config)
    fields = arm.upstream.model_dump()
    config = UpstreamConfig(**{**fields, "base_urls": tuple(fields["base_urls"])})
    return UpstreamArm(arm.name, config, arm.weight)


def deployment_from_settings(settings: Settings) -> Deployment:
    """The deployment `settings` describe, served as `settings.model_name`."""
    weights = SharedWeights(settings)
    if not settings.arms:
        return Deployment(
            settings.model_name, [local_arm(settings, settings.scheduler, 1.0, weights)]
        )
    arms: list[Arm] = []
    for spec in settings.arms:
        if spec.upstream is not None:
            arm: Arm = upstream_arm(spec)
        else:
            arm = local_arm(arm_settings(settings, spec), spec.name, spec.weight, weights)
        arm.shadow, arm.shadow_fraction = spec.shadow, spec.shadow_fraction
        arm.pinnable = spec.pinnable
        arms.append(arm)
    deployment = Deployment(settings.model_name, arms)
    specs = {spec.name: spec for spec in settings.arms}
    for mirror in deployment.mirrors:
        spec = specs[mirror.arm.name]
        mirror.queue_size, mirror.concurrency = spec.shadow_queue_size, spec.shadow_concurrency
    return deployment
