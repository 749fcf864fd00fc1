"""How a reward or metric function's parameters are bound: by position (ours) or by name (ours or TRL's).

Standard library only, so the reward worker processes (`lit_rlhf.rewards.isolation`) bind exactly as the
training process does. Three forms are accepted, chosen from the function's signature:

- **TRL's**: a parameter named `completions`, or only `**kwargs`: called by keyword as TRL's `GRPOTrainer` calls
  it: `prompts=`, `completions=` (the responses) and every extra column of the prompt rows (all of them when the
  function takes `**kwargs`, else those it names). When the rows are conversations (their messages column holds
  a message list, or such a list as a JSON string), `prompts` are those message lists and each completion is a
  message list `[{"role": "assistant", "content": response}]`, as TRL passes them; otherwise both are strings.
- **ours by name**: a parameter named `responses`: called by keyword, `prompts=`, `responses=` and the columns.
- **ours by position**: `fn(prompts, responses, **meta)`: the first two positional parameters (whatever their
  names) take the prompt and response texts, the columns go by keyword.

Anything else (one positional parameter, a positional-only parameter among named ones, `completion_ids` or
`prompt_ids` without a default: token ids are not passed) is refused when the function is set up.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
TEXTS = ("prompts", "responses", "completions")
"""The parameter names that take the batch's texts rather than a column."""
NOT_PASSED = ("completion_ids", "prompt_ids", "trainer_state")
"""TRL names lit_rlhf does not pass: such a parameter needs a default."""
MESSAGES_COLUMN = "messages"
FORMS = (
    "accepted forms: fn(prompts, responses, **columns) (by position); fn(*, prompts, responses, **columns) (by "
    "name); TRL's fn(completions, prompts=None, **kwargs) (by name; completions as message lists when the prompt "
    "rows are conversations); a column is a parameter named like a prompt-row column"
)


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
        return [p for p in named if p not in texts]
    return [p for p in named if p.name not in TEXTS and p.name not in NOT_PASSED]


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


def call(fn: Callable[..., Any], prompts: list[str], responses: list[str], meta: dict[str, list[Any]]) -> Any:
    """`fn`'s answer for the batch, its parameters bound by its form."""
    kind = form(fn)
    if kind == "positional":
        return fn(prompts, responses, **meta)
    params = parameters(fn) or []
    if kind == "trl":
        texts, completions = trl_texts(prompts, responses, meta)
        given: dict[str, Any] = {**meta, "prompts": texts, "completions": completions}
    else:
        given = {**meta, "prompts": prompts, "responses": responses}
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        wanted = {p.name for p in params}
        given = {k: v for k, v in given.items() if k in wanted}
    return fn(**given)
