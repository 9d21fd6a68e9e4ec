"""Image input over the state cache (Qwen3.5 with images, models/qwen3_5_vl.py): the classes of
features/multimodal.py and features/state_cache.py together, each step's message carrying both
layers' fields. (Named classes of a module, not made on the fly: the message travels to
tensor-parallel ranks pickled, which finds a class by its name.)"""
from dataclasses import dataclass

from nanovllm.features.multimodal import (MultimodalRunner, MultimodalScheduledStep, MultimodalScheduler,
                                         MultimodalStepBatch)
from nanovllm.features.state_cache import StateRunner, StateScheduledStep, StateScheduler, StateStepBatch


@dataclass
class MultimodalStateStepBatch(MultimodalStepBatch, StateStepBatch):
    pass


@dataclass
class MultimodalStateScheduledStep(MultimodalScheduledStep, StateScheduledStep):
    Batch = MultimodalStateStepBatch


class MultimodalStateScheduler(MultimodalScheduler, StateScheduler):
    Step = MultimodalStateScheduledStep


class MultimodalStateRunner(MultimodalRunner, StateRunner):
    pass
