"""Scheduling for pipeline stages, on CPU with the fake model of
``test_core_scheduler``: with ``pipeline_parallel_size`` stages the engine
core keeps that many steps in flight, no request runs again while a step
in flight samples its next token (a prompt's chunks may follow each other:
every stage runs the steps in order), each step takes its share of the
requests, and the outputs are the one-step-at-a-time outputs (the fake
model's token depends on every earlier token), also under preemption and
random adds and aborts."""

from __future__ import annotations

import random

import pytest

from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.engine.engine_core import EngineCore
from tests.unit.test_core_scheduler import (
    FakeExecutor,
    FakeStep,
    make_core,
    make_request,
    run_core_to_completion,
)


class InFlightStep(FakeStep):
    def __init__(self, step: FakeStep, executor: PipelineExecutor, ids: set[str]) -> None:
        super().__init__(step.sampling)
        self.executor, self.ids = executor, ids

    def get(self) -> ModelRunnerOutput:
        self.executor.in_flight.remove(self.ids)
        return super().get()


class PipelineExecutor(FakeExecutor):
    """The fake model, checking no request runs while its next token is in flight."""

    def __init__(self, base: FakeExecutor) -> None:
        super().__init__(base.scheduler, base.num_kv_blocks)
        self.in_flight: list[set[str]] = []
        self.steps: list[SchedulerOutput] = []
        self.most_in_flight = 0

    def execute_model(self, out: SchedulerOutput) -> FakeStep:
        ids = set(out.num_scheduled_tokens)
        for sampling in self.in_flight:
            assert not ids & sampling, f"{ids & sampling} scheduled while sampling"
        fake = super().execute_model(out)
        step = InFlightStep(fake, self, {r.request_id for r in fake.sampling})
        self.in_flight.append(step.ids)
        if not out.is_empty:
            self.steps.append(out)
            self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return step


def pipelined_core(stages: int, **kwargs: object) -> tuple[EngineCore, PipelineExecutor]:
    core = make_core(True, pipeline_parallel_size=stages, **kwargs)
    executor = PipelineExecutor(core.executor)  # type: ignore[arg-type]
    core.executor = executor
    return core, executor


def _requests(count: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    return [(f"r{i}", [3 + rng.randrange(40) for _ in range(rng.randrange(1, 30))],
             rng.randrange(1, 12)) for i in range(count)]


def _outputs(core: EngineCore, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    for request_id, prompt, max_tokens in requests:
        core.add_request(make_request(request_id, prompt, max_tokens))
    return run_core_to_completion(core)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("num_blocks", [12, 64])  # 12: preemption
def test_stages_keep_steps_in_flight_with_requests_of_their_own(stages: int,
                                                                num_blocks: int) -> None:
    requests = _requests(7)
    expected = _outputs(make_core(False, num_blocks=num_blocks), requests)
    core, executor = pipelined_core(stages, num_blocks=num_blocks)
    assert _outputs(core, requests) == expected
    if num_blocks == 64:  # each step takes at most its share of the 7 requests
        assert executor.most_in_flight == stages
        assert max(len(out.num_scheduled_tokens) for out in executor.steps) <= -(-7 // stages)
    else:
        assert core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("seed", range(4))
def test_randomised_adds_and_aborts_with_stages(seed: int) -> None:
    rng = random.Random(seed)
    core, _ = pipelined_core(rng.choice([2, 4]), num_blocks=rng.choice([10, 24, 64]),
                             max_num_seqs=rng.choice([2, 8]), max_model_len=64)
    live: list[str] = []
    for index in range(200):
        action = rng.random()
        if action < 0.15:
            prompt = [3 + rng.randrange(40) for _ in range(rng.randrange(1, 20))]
            try:
                core.add_request(make_request(f"q{index}", prompt, rng.randrange(1, 12)))
                live.append(f"q{index}")
            except ValueError:
                pass
        elif action < 0.2 and live:
            core.abort_requests([live.pop(rng.randrange(len(live)))])
        else:
            core.step()
    run_core_to_completion(core)
    pool = core.scheduler.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
