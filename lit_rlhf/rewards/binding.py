"""How a reward or metric function's parameters are bound: by position (ours) or by name (ours or TRL's).

Standard library only, so the reward worker processes (`lit_rlhf.rewards.isolation`) bind exactly as the
training process does. Three forms are accepted, chosen from the function's signature:

- **TRL's**: a parameter named `completions`, or only `**kwargs`: called by keyword as TRL's `GRPOTrainer` calls
  it: `prompts=`, `completions=` (the responses) and every extra column of the prompt rows (all of them when the
  function takes `**kwargs`, else those it names). When the rows are conversations (a message list, or such a list
  as a JSON string, in their prompt or messages column: the batch's `messages` column), `prompts` are those message
  lists and each completion is a message list `[{"role": "assistant", "content": response}]`, as TRL passes them;
  otherwise both are strings.
- **ours by name**: a parameter named `responses`: called by keyword, `prompts=`, `responses=` and the columns.
- **ours by position**: `fn(prompts, responses, **meta)`: the first two positional parameters (whatever their
  names) take the prompt and response texts, the columns go by keyword.

TRL's `trainer_state` (a `TrainerState`: `global_step`, `epoch`, `max_steps`, read when the batch is scored) goes
to every TRL-form function that names it or takes `**kwargs`, and to any other function that names it. An `async
def` function (or an object whose `__call__` is one) is awaited: `call` runs it to completion, and the composer
runs a batch's async calls concurrently on one event loop (`lit_rlhf.rewards.parallel`).

Anything else (one positional parameter, a positional-only parameter among named ones, `completion_ids` or
`prompt_ids` without a default: token ids are not passed) is refused when the function is set up.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

Fn = Callable[..., Any]
Meta = dict[str, list[Any]]
"""A batch's extra prompt columns, one list of B values each."""
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
TEXTS = ("prompts", "responses", "completions")
"""The parameter names that take the batch's texts rather than a column."""
NOT_PASSED = ("completion_ids", "prompt_ids")
"""TRL names lit_rlhf does not pass: such a parameter needs a default."""
STATE = "trainer_state"
"""The parameter that takes the training progress (`TrainerState`), as TRL names it."""
MESSAGES_COLUMN = "messages"
FORMS = (
    "accepted forms: fn(prompts, responses, **columns) (by position); fn(*, prompts, responses, **columns) (by "
    "name); TRL's fn(completions, prompts=None, **kwargs) (by name; completions as message lists when the prompt "
    "rows are conversations); a column is a parameter named like a prompt-row column"
)


@dataclass(frozen=True)
class TrainerState:
    """The training progress a reward function sees as `trainer_state` (the fields TRL's `TrainerState` has).

    `global_step`: optimizer steps taken so far (Lightning's `trainer.global_step`: `ppo_epochs x num_minibatches`
    per rollout); `epoch`: epochs done, fractional (1.5: half-way through the second); `max_steps`: the optimizer
    steps the run will take (-1 when unbounded)."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = -1


class SignatureError(ValueError):
    """A function whose parameters cannot be bound; the message says why and lists the accepted forms."""


def parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """`fn`'s parameters, or None when its signature cannot be read (a builtin: called by position)."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def form(fn: Callable[..., Any]) -> str:
    """'trl', 'named' or 'positional' (see the module docstring); a `SignatureError` for anything else."""
    params = parameters(fn)
    if params is None:
        return "positional"
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    if "completions" in names and "responses" in names:
        raise SignatureError(f"takes both `completions` and `responses`; name the responses once. {FORMS}")
    for p in params:
        if p.name in NOT_PASSED and p.default is p.empty and p.kind is not p.VAR_KEYWORD:
            raise SignatureError(
                f"needs `{p.name}` (no default), which lit_rlhf does not pass; give it a default. {FORMS}"
            )
    if "completions" in names or "responses" in names or (var_kw and not any(p.kind in POSITIONAL for p in params)):
        positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
        if positional_only:
            raise SignatureError(f"is called by name, but {positional_only} are positional-only. {FORMS}")
        return "trl" if "completions" in names or "responses" not in names else "named"
    if sum(p.kind in POSITIONAL for p in params) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        shown = ", ".join(p.name for p in params) or "nothing"
        raise SignatureError(f"takes ({shown}): not the prompts and the responses. {FORMS}")
    return "positional"


def column_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The parameters of `fn` that take prompt-row columns (by keyword), in order."""
    params = parameters(fn) or []
    named = [p for p in params if p.kind in (*POSITIONAL, p.KEYWORD_ONLY)]
    if form(fn) == "positional":
        texts = [p for p in params if p.kind in POSITIONAL][:2]
        return [p for p in named if p not in texts and p.name != STATE]
    return [p for p in named if p.name not in (*TEXTS, *NOT_PASSED, STATE)]


def _conversation(value: Any) -> list[Any] | None:
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, list) and all(isinstance(m, dict) for m in value) and value else None


def trl_texts(prompts: list[str], responses: list[str], meta: dict[str, list[Any]]) -> tuple[list[Any], list[Any]]:
    """(prompts, completions) as TRL passes them: message lists when every row is a conversation."""
    conversations = [_conversation(v) for v in meta.get(MESSAGES_COLUMN) or []]
    if len(conversations) != len(prompts) or not conversations or any(c is None for c in conversations):
        return prompts, responses
    return conversations, [[{"role": "assistant", "content": r}] for r in responses]


def start(fn: Fn, prompts: list[str], responses: list[str], meta: Meta, state: TrainerState | None = None) -> Any:
    """`fn` called on the batch, its parameters bound by its form: its answer, or the awaitable an async function
    returns (not awaited)."""
    kind = form(fn)
    params = parameters(fn) or []
    names = {p.name for p in params}
    if kind == "positional":
        return fn(prompts, responses, **meta, **({STATE: state} if STATE in names else {}))
    if kind == "trl":
        texts, completions = trl_texts(prompts, responses, meta)
        given: dict[str, Any] = {**meta, "prompts": texts, "completions": completions, STATE: state}
    else:
        given = {**meta, "prompts": prompts, "responses": responses}
        if STATE in names:
            given[STATE] = state
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        given = {k: v for k, v in given.items() if k in names}
    return fn(**given)


def call(fn: Fn, prompts: list[str], responses: list[str], meta: Meta, state: TrainerState | None = None) -> Any:
    """`fn`'s answer for the batch, its parameters bound by its form; an async function's answer awaited."""
    return settle(start(fn, prompts, responses, meta, state))


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether `fn` is an `async def` function (or a partial of one, or an object with an async `__call__`)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


async def _awaited(answer: Awaitable[Any]) -> Any:
    return await answer


def settle(answer: Any) -> Any:
    """`answer`, or what it resolves to when it is awaitable (run on an event loop of its own: on this thread, or
    on a thread of its own when this one already runs a loop, as in a notebook)."""
    if not inspect.isawaitable(answer):
        return answer
    return run_on_own_loop(_awaited(answer))


def run_on_own_loop(coroutine: Any) -> Any:
    """`asyncio.run(coroutine)`, on a helper thread when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = asyncio.run(coroutine)
        except BaseException as err:  # raised again in the calling thread
            outcome["error"] = err

    thread = threading.Thread(target=run, name="lit_rlhf-async-reward", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
