"""POST /slots/{id}?action=save|restore|erase: llama-server's slot save, restore and erase.

Enabled by `--slot-save-path DIR` (else 501, as llama-server answers). `save` and `restore` take
`{"filename": NAME}`, a plain file name inside DIR; the engine runs the action between steps once the
slot is idle (an action on a busy slot waits for its request, as llama-server defers it;
core/engine/slot_actions.py). Errors: a bad slot id, action, body or file name, and a file that is not
this model's slot file, are 400 (invalid_request_error); a write that fails (a full disk) 500
(server_error), with no file left behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from spekula.core.engine.slot_actions import SlotActionError
from spekula.core.engine.slot_file import SlotFileError, slot_path
from spekula.frontends.http.errors import HttpError
from spekula.frontends.http.generation import cancel_on_disconnect

if TYPE_CHECKING:
    from pathlib import Path

    from spekula.frontends.http.state import HttpState

ERROR_TYPES = {"invalid": "invalid_request_error", "busy": "unavailable_error", "unavailable": "unavailable_error",
               "unsupported": "not_supported_error", "io": "server_error"}


@runtime_checkable
class SlotActions(Protocol):
    """An engine that saves, restores and erases its slots (a local Engine; not the Ray router)."""

    async def slot_action(self, action: str, slot_id: int, path: Path | None = None) -> dict[str, Any]: ...


async def slot_action(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    if state.slot_save_path is None:
        raise HttpError("This server does not support slots action. Start it with `--slot-save-path`",
                        "not_supported_error")
    if not isinstance(engine, SlotActions):
        raise HttpError("slot save/restore/erase needs the engine in this process (not behind the Ray router)",
                        "not_supported_error")
    raw_id = request.path_params.get("id_slot", "")
    try:
        slot_id = int(raw_id)
    except ValueError:
        raise HttpError(f"Invalid slot ID {raw_id!r}") from None
    action = request.query_params.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise HttpError(f"Invalid action {action!r}: save, restore or erase")
    path = None
    if action != "erase":
        body = await state.read_json(request)
        if not isinstance(body, dict) or "filename" not in body:
            raise HttpError(f"slot {action} needs a JSON body with \"filename\"")
        try:
            path = slot_path(state.slot_save_path, body["filename"])
        except SlotFileError as exc:
            raise HttpError(str(exc)) from None
    outcome: list[dict[str, Any] | SlotFileError | SlotActionError] = []
    async with anyio.create_task_group() as tg:  # a client gone while the action waits cancels it

        async def act() -> None:
            try:
                outcome.append(await engine.slot_action(action, slot_id, path))
            except (SlotFileError, SlotActionError) as exc:
                outcome.append(exc)
            finally:
                tg.cancel_scope.cancel()

        tg.start_soon(cancel_on_disconnect, request.receive, tg.cancel_scope.cancel)
        tg.start_soon(act)
    if not outcome:
        raise HttpError("the client went away before the slot action ran", "unavailable_error")
    result = outcome[0]
    if isinstance(result, SlotFileError):
        raise HttpError(f"Unable to restore slot {slot_id}: {result}")
    if isinstance(result, SlotActionError):
        raise HttpError(str(result), ERROR_TYPES.get(result.kind, "server_error"))
    return JSONResponse(result)
