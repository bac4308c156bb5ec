"""The error every client call to a node ends with when it fails, whichever transport carried it."""

from __future__ import annotations

import grpc


class NodeCallError(RuntimeError):
    """A call to a node failed: `code` is the grpc.StatusCode, `details` the node's message."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, details: str) -> None:
        self.address = address
        self.method = method
        self.code = code
        self.details = details
        super().__init__(f"{method} on node {address} failed: {code.name}: {details}")


def wrap_rpc_error(address: str, method: str, e: grpc.RpcError) -> NodeCallError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return NodeCallError(address, method, code, details or "")
