"""The one error a request field raises in every frontend: -32602 on the socket, 400 over HTTP."""

from __future__ import annotations

from spekula.frontends.rpc.protocol import INVALID_PARAMS, RpcError


class ParamError(RpcError):
    """A request field the server cannot accept; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(INVALID_PARAMS, message)
        self.field = field


def invalid_params(message: str, field: str = "") -> ParamError:
    return ParamError(field, message)
