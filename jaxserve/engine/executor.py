"""Who runs the engine core's steps: ``StepExecutor``, the runner's three calls and the checks
around them. One host runs them on its own runner (``LocalExecutor``); rank 0 of a multi-node
engine sends each call on to the other hosts before it runs it
(``jaxserve.distributed.lockstep.LockstepLeader``). ``EngineCore`` holds one and never asks which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from jaxserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from jaxserve.runner.model_runner import InFlightStep, ModelRunner, PreparedStep


class StepExecutor(Protocol):
    def prepare(self, so: SchedulerOutput) -> PreparedStep: ...

    def launch(self, prepared: PreparedStep, bitmask: np.ndarray | None) -> InFlightStep: ...

    def collect(self, step: InFlightStep) -> ModelRunnerOutput: ...

    def check(self) -> None:
        """Raise ``NodeLostError`` if another host was lost; cheap enough for every idle wait."""

    def shutdown(self) -> None:
        """Release whatever runs the steps besides this process's runner."""


class LocalExecutor:
    """One host: the runner's calls as they are."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def prepare(self, so: SchedulerOutput) -> PreparedStep:
        return self.runner.prepare(so)

    def launch(self, prepared: PreparedStep, bitmask: np.ndarray | None) -> InFlightStep:
        return self.runner.launch(prepared, bitmask)

    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        return self.runner.collect(step)

    def check(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
