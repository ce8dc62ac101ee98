"""Lockstep stepping of a multi-node engine: rank 0 leads, the other ranks replay its runner calls.

Rank 0's ``EngineCore`` makes every runner call through :class:`LockstepLeader`, which queues the
call as a message and publishes the queue when a step is launched, so each follower dispatches
the same compiled step as soon as rank 0 does and their collectives meet. A follower
(:class:`LockstepFollower`) applies the calls to its own runner in the same order: the same
``SchedulerOutput`` gives the same request states, slots, seeds and packed inputs on every host.

A step without scheduled tokens never reaches the device and is never collected by the engine
core, so neither side queues it for collection. Only rank 0 turns tokens into outputs; the
followers' collect keeps their host-side rows in step.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.distributed.channel import ControlChannel
from jaxserve.distributed.liveness import NodeMonitor
from jaxserve.distributed.messages import Collect, Launch, Prepare, RunnerCall, Shutdown
from jaxserve.exceptions import NodeLostError

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import InFlightStep, ModelRunner, PreparedStep

logger = logging.getLogger("jaxserve")

# A follower's longest wait for the next message before it looks again (rank 0 may idle for long).
RECEIVE_TIMEOUT_S = 1.0
# Rank 0's longest wait, when stopping, for the followers to read the stop message.
SHUTDOWN_WAIT_S = 5.0


class LockstepLeader:
    """Rank 0's side: the runner calls, sent on before they run; bounded waits for tokens."""

    def __init__(self, runner: ModelRunner, channel: ControlChannel, monitor: NodeMonitor):
        self.runner = runner
        self.channel = channel
        self.monitor = monitor
        self._queued: list[RunnerCall] = []
        self._stopped = False

    def prepare(self, so: SchedulerOutput) -> PreparedStep:
        self._queued.append(Prepare(so))
        return self.runner.prepare(so)

    def launch(self, prepared: PreparedStep, bitmask: np.ndarray | None) -> InFlightStep:
        self.monitor.check()  # no new step for a group that lost a host
        self._queued.append(Launch.of(bitmask))
        self._flush()
        return self.runner.launch(prepared, bitmask)

    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        if step.out is None:  # never launched on the device: nothing to wait for or replay
            return self.runner.collect(step)
        self._queued.append(Collect())
        try:
            self.monitor.wait_ready(step.out.sampled_token_ids)
            return self.runner.collect(step)
        except NodeLostError:
            raise
        except Exception as exc:  # a collective whose peer went away fails before the heartbeats stop
            lost = self.monitor.explain(exc)
            if lost is not None:
                raise lost from exc
            raise

    def check(self) -> None:
        """Raise :class:`NodeLostError` if a follower is lost (read at most a few times a second)."""
        self.monitor.check()

    def shutdown(self) -> None:
        """Tell the followers to leave their loops and wait (boundedly) until they have read it, so
        they disconnect before this process takes the coordination service down. Best effort:
        they may be gone already. Runs once (the engine's shutdown, or at the latest at exit)."""
        if self._stopped:
            return
        self._stopped = True
        self._queued.append(Shutdown())
        try:
            self._flush()
            if not self.channel.wait_read(SHUTDOWN_WAIT_S):
                logger.warning("the other nodes did not take the stop message within %g s", SHUTDOWN_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - shutting down anyway; a lost node needs no message
            logger.warning("could not tell the other nodes to stop: %s", exc)

    def _flush(self) -> None:
        self.channel.publish(self._queued)
        self.monitor.note_published()
        self._queued = []


class LockstepFollower:
    """A rank > 0: replays rank 0's runner calls on ``runner`` until told to stop."""

    def __init__(self, runner: ModelRunner, channel: ControlChannel):
        self.runner = runner
        self.channel = channel
        self._prepared: collections.deque[PreparedStep] = collections.deque()
        self._launched: collections.deque[InFlightStep] = collections.deque()
        self.steps = 0
        self.messages_applied = 0  # the step progress its heartbeat reports (rank 0's watchdog reads it)

    def run(self) -> None:
        """Return on rank 0's shutdown message; raise :class:`NodeLostError` when rank 0 is gone."""
        while True:
            try:
                calls = self.channel.receive(RECEIVE_TIMEOUT_S)
            except Exception as exc:
                raise NodeLostError(f"rank 0 is unreachable (its coordination service stopped): {exc}") from exc
            for call in calls or ():
                if isinstance(call, Shutdown):
                    return
                self.apply(call)
            if calls is not None:
                self.messages_applied += 1

    def apply(self, call: RunnerCall) -> None:
        if isinstance(call, Prepare):
            self._prepared.append(self.runner.prepare(call.scheduler_output))
        elif isinstance(call, Launch):
            step = self.runner.launch(self._prepared.popleft(), call.bitmask_array())
            if step.out is not None:
                self._launched.append(step)
                self.steps += 1
        elif isinstance(call, Collect):
            self.runner.collect(self._launched.popleft())
        else:
            raise TypeError(f"not a runner call: {call!r}")
