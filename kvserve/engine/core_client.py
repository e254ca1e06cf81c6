"""How the front end (``LLMEngine``) talks to the engine core, wherever it runs.

``EngineCoreRequest`` is what crosses: plain data (token ids, resolved
``SamplingParams``, EOS ids, priority, adapter), never text. ``CoreClient``
is the interface; ``InprocCoreClient`` steps an ``EngineCore`` in the
caller's thread (offline ``LLM``, tests, the CPU server by default), and
``core_proc.MPCoreClient`` runs the core in its own process behind the same
methods. The differences a caller may see: an in-process core raises a
rejection (``ValueError``) from ``add_request`` and reports aborts at once;
a core process reports both later, from ``step`` (``take_rejections``) —
and its ``step`` waits for the core's next outputs instead of running one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.core.outputs import EngineCoreOutput
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.engine_core import EngineCore
from kvserve.lora.request import LoRARequest


class EngineDeadError(RuntimeError):
    """The engine loop or its core process has stopped; no request can proceed."""


@dataclass
class EngineCoreRequest:
    """One core request (one sample of a user request): what the core needs."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # max_tokens set, EOS ids and any grammar bound
    priority: int = 0
    lora_request: LoRARequest | None = None
    # False: report only the first output and the last (see Request)
    report_every_step: bool = True
    arrival_s: float = 0.0

    def to_request(self) -> Request:
        params = self.sampling_params
        lora_int_id = self.lora_request.lora_int_id if self.lora_request is not None else 0
        return Request(self.request_id, self.prompt_token_ids, params, params.eos_token_ids,
                       self.priority, lora_int_id=lora_int_id,
                       report_every_step=self.report_every_step, arrival_s=self.arrival_s)


@dataclass
class Rejection:
    """A request the core refused: ``internal`` False is bad input (a
    ``ValueError``, HTTP 400), True a message it could not process (500)."""

    request_id: str
    message: str
    internal: bool = False

    def error(self) -> Exception:
        return RuntimeError(self.message) if self.internal else ValueError(self.message)


class CoreClient(Protocol):
    """The engine core as the front end drives it."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]: ...

    def finish_stopped(self, request_ids: list[str]) -> None: ...

    def step(self) -> list[EngineCoreOutput]: ...

    def take_rejections(self) -> list[Rejection]: ...

    def add_lora(self, lora_request: LoRARequest) -> None: ...

    def remove_lora(self, lora_int_id: int) -> bool: ...

    def get_request(self, request_id: str) -> Request | None: ...

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if the core has stopped."""

    def wake(self) -> None:
        """Make a ``step`` waiting for outputs return now (thread-safe)."""

    def last_progress_s(self) -> float:
        """When the core was last seen making progress (``time.monotonic``)."""

    def stats(self) -> dict[str, Any]: ...

    @property
    def num_steps(self) -> int: ...

    def shutdown(self, kill: bool = False) -> None: ...


class InprocCoreClient:
    """The core in this process: every call runs it directly."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    @property
    def executor(self) -> Any:
        return self.core.executor

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.lora_request is not None:
            self.core.add_lora(request.lora_request)
        self.core.add_request(request.to_request())

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.core.abort_requests(request_ids)

    def finish_stopped(self, request_ids: list[str]) -> None:
        self.core.finish_stopped(request_ids)

    def step(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def take_rejections(self) -> list[Rejection]:
        return []  # add_request raised them

    def add_lora(self, lora_request: LoRARequest) -> None:
        self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.core.remove_lora(lora_int_id)

    def get_request(self, request_id: str) -> Request | None:
        return self.core.get_request(request_id)

    def check_alive(self) -> None:
        self.core.housekeep()  # the idle loop's turn: in-process the core cannot die alone

    def wake(self) -> None:
        pass

    def last_progress_s(self) -> float:
        return time.monotonic()  # asked between two steps

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def shutdown(self, kill: bool = False) -> None:
        self.core.shutdown(kill)
