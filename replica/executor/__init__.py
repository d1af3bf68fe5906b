"""The executor: turns a SchedulerOutput into one forward pass and one sampled token per
request that caught up (model runner, persistent device inputs, CUDA graphs, sampler)."""

from replica.executor.model_runner import ModelRunner, ModelRunnerOutput

__all__ = ["ModelRunner", "ModelRunnerOutput"]
